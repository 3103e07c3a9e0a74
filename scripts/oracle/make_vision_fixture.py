#!/usr/bin/env python3
"""Writes strata's image-input fixture with Hugging Face transformers as the oracle.

A tiny, randomly initialised Qwen3.5 with a vision tower (`Qwen3_5ForConditionalGeneration`),
laid out as real releases are (config.json with `vision_config`, `model.visual.*` weights, a
tokenizer with the vision tokens, `preprocessor_config.json` for transformers' image processor),
two PNG images and `reference.safetensors` / `reference.json` holding what transformers computes:

  pixels_a, grid_a   the processor's `pixel_values` / `image_grid_thw` for image-a.png, whose
                     size needs no resize (both sides multiples of patch x merge, within bounds)
  pixels_b, grid_b   the same for image-b.png, which the processor resizes (above max_pixels)
  resized_b          image-b.png after the processor's resize, in [0, 1] (before normalization)
  features_a, _b     the vision tower's merged output for each image ([tokens, text hidden])
  tokens             a prompt with text, image a, text, image b, text (image pads expanded)
  position_ids       `get_rope_index`'s mRoPE positions for it ([3, T]) and, in reference.json,
                     its rope delta
  logits             f32 logits of every prompt position
and in reference.json the 16 greedy tokens after the prompt (through transformers' cache).

Needs torch, torchvision, pillow and transformers >= 5 with the qwen3_5 classes.
Run:  python3 scripts/oracle/make_vision_fixture.py OUT_DIR   (then copy OUT_DIR/* to fixtures/vision/)
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from tokenizers import AddedToken
from transformers import Qwen2VLImageProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402

NAME = "qwen3_5-vl-tiny-g"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SEED = 7


def make_images(path):
    """Two RGB images with structure (gradients, a disc, noise) so resizing and the position
    interpolation matter: a 32x24 one that needs no resize and a 100x70 one above max_pixels."""
    g = np.random.default_rng(SEED)

    def draw(w, h):
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        r = 255 * x / (w - 1)
        gch = 255 * (0.5 + 0.5 * np.sin(y / 3.0))
        b = 255 * (((x - w / 2) ** 2 + (y - h / 2) ** 2) < (min(w, h) / 3) ** 2)
        img = np.stack([r, gch, b], -1) + g.normal(0, 20, (h, w, 3))
        return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")

    a, b = draw(32, 24), draw(100, 70)
    a.save(os.path.join(path, "image-a.png"))
    b.save(os.path.join(path, "image-b.png"))
    return Image.open(os.path.join(path, "image-a.png")), Image.open(os.path.join(path, "image-b.png"))


def main():
    out = os.path.join(sys.argv[1], NAME)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(SEED)

    tok = make_fixtures.build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    vocab = 520
    assert tok.get_vocab_size() <= vocab

    # Rotary dims 16 (head_dim 32, partial 0.5): 8 frequencies in interleaved sections [3, 3, 2],
    # so the temporal, height and width streams each drive some of them.
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                rms_norm_eps=1e-6, max_position_embeddings=131072, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    # A 4x4 learned position grid interpolated to each image's patch grid; two ViT blocks.
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = Qwen3_5ForConditionalGeneration(config).eval()
    make_fixtures.randomise(model, SEED)
    model.config.eos_token_id = [2]
    model.save_pretrained(out)

    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "model_max_length": 262144,
                   "chat_template": open(os.path.join(make_fixtures.HERE, "chat_template.jinja")).read()}, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f, indent=2)

    # As released Qwen3.5 checkpoints configure it, at the fixture's patch size: pixel bounds in
    # `size`, mean and std 0.5. 8x8 pixels is one merged token; at most 64 of them.
    processor = Qwen2VLImageProcessor(size={"shortest_edge": 4 * 64, "longest_edge": 64 * 64}, patch_size=4,
                                      temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                                      image_std=[0.5, 0.5, 0.5])
    processor.save_pretrained(out)
    image_a, image_b = make_images(out)

    ref = {}
    proc_a, proc_b = processor(images=[image_a], return_tensors="pt"), processor(images=[image_b], return_tensors="pt")
    grid_a, grid_b = proc_a["image_grid_thw"], proc_b["image_grid_thw"]
    assert grid_a[0].tolist() == [1, 24 // 4, 32 // 4], grid_a
    (_, gh, gw) = grid_b[0].tolist()
    resized = processor.resize(torch.from_numpy(np.array(image_b)).permute(2, 0, 1)[None], size=processor.size,
                               resample=processor.resample, factor=8)
    assert list(resized.shape[-2:]) == [gh * 4, gw * 4], (resized.shape, grid_b)

    merge = 4
    n_a, n_b = int(grid_a.prod()) // merge, int(grid_b.prod()) // merge
    enc = lambda s: tok.encode(s).ids
    v = lambda n: [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * n + [ids["<|vision_end|>"]]
    prompt = enc("Look at this: ") + v(n_a) + enc(" and compare it with ") + v(n_b) + enc(" What differs?")
    input_ids = torch.tensor([prompt])
    types = (input_ids == ids["<|image_pad|>"]).int()
    both = processor(images=[image_a, image_b], return_tensors="pt")
    assert torch.equal(both["pixel_values"], torch.cat([proc_a["pixel_values"], proc_b["pixel_values"]]))

    model = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        feats = model.model.get_image_features(both["pixel_values"], both["image_grid_thw"]).pooler_output
        positions, delta = model.model.get_rope_index(input_ids, types, image_grid_thw=both["image_grid_thw"])
        kwargs = dict(pixel_values=both["pixel_values"], image_grid_thw=both["image_grid_thw"], mm_token_type_ids=types)
        logits = model(input_ids=input_ids, **kwargs).logits[0].float()
        # Greedy decoding through transformers' cache (decode positions continue with the delta).
        model.model.rope_deltas = None
        out_ = model(input_ids=input_ids, use_cache=True, **kwargs)
        cache, last = out_.past_key_values, out_.logits[0, -1]
        greedy, margin = [], float("inf")
        for _ in range(16):
            top = torch.topk(last, 2).values
            margin = min(margin, (top[0] - top[1]).item())
            greedy.append(int(torch.argmax(last)))
            out_ = model(input_ids=torch.tensor([[greedy[-1]]]), past_key_values=cache, use_cache=True)
            cache, last = out_.past_key_values, out_.logits[0, -1]
    assert margin > 1e-3, f"greedy margin {margin} too small; pick another seed"

    save_file({
        "pixels_a": proc_a["pixel_values"].contiguous(), "grid_a": grid_a.contiguous(),
        "pixels_b": proc_b["pixel_values"].contiguous(), "grid_b": grid_b.contiguous(),
        "resized_b": (resized[0].float() / 255).contiguous(),
        "features_a": feats[0].contiguous(), "features_b": feats[1].contiguous(),
        "tokens": input_ids[0].to(torch.int64), "position_ids": positions[:, 0].contiguous(),
        "logits": logits.contiguous(),
    }, os.path.join(out, "reference.safetensors"))
    ref.update({"transformers": transformers.__version__, "torch": torch.__version__,
                "rope_delta": int(delta[0, 0]), "greedy_tokens": greedy, "greedy_margin": margin,
                "image_tokens": [n_a, n_b], "vision_token_ids": ids})
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(NAME, "prompt", len(prompt), "image tokens", n_a, n_b, "grid_b", grid_b[0].tolist(),
          "margin", round(margin, 5))


if __name__ == "__main__":
    main()
