#!/usr/bin/env python3
"""Gives a Qwen3.5 fixture a multi-token-prediction head and the oracle's outputs for it.

Qwen3.5 releases ship an MTP head under `mtp.*` (config `mtp_num_hidden_layers`) that
transformers does not run. Its public definition (as vLLM and SGLang serve it): for position i,
with the target's final, normed hidden state h_i and the next token x_{i+1},

    x = fc([pre_fc_norm_embedding(embed(x_{i+1})) ; pre_fc_norm_hidden(h_i)])
    y = norm(decoder_layer(x))          # one full-attention Qwen3.5 decoder layer, at position i
    logits = lm_head(y)                 # embed and lm_head are the target's

and a further draft step feeds the head's own `y` where h would be. The oracle here is that
definition built from transformers' own `Qwen3_5DecoderLayer` (the class the MTP layer is an
instance of), fed transformers' hidden states. Writes `mtp.*` weights (random, rounded to the
fixture's disk dtype) into the fixture and `mtp_*` tensors into its reference.safetensors:
  mtp_hidden        the target's normed final hidden states over the reference prompt
  mtp_logits        the head over (prompt[1:], hidden[:-1]) at positions 0..n-2
  mtp_chain_logits  one more step: argmax of the last row, fed with the head's own last y

Run:  python3 scripts/oracle/add_mtp_head.py fixtures/qwen3_5-tiny-a [...]
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

# By config model_type: (decoder layer class, nested model class, flat model class).
FAMILIES = {
    "qwen3_5": (Qwen3_5DecoderLayer, Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM),
    "qwen3_5_text": (Qwen3_5DecoderLayer, Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM),
    "qwen3_5_moe": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM),
    "qwen3_5_moe_text": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM),
}


def text_config_json(config):
    return config.get("text_config", config)


def disk_dtype(path):
    """The dtype the fixture's weights are stored in."""
    first = sorted(f for f in os.listdir(path) if f.startswith("model") and f.endswith(".safetensors"))[0]
    return next(iter(load_file(os.path.join(path, first)).values())).dtype


def random_head(text_cfg, layer_class, seed, dtype):
    """The head's tensors by checkpoint name (experts fused, as the layer class holds them),
    random (spread like the fixture's other weights) and rounded to the fixture's disk dtype."""
    g = torch.Generator().manual_seed(seed)
    hidden = text_cfg.hidden_size
    full = text_cfg.layer_types.index("full_attention")
    layer = layer_class(text_cfg, full)
    tensors = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.empty(hidden, 2 * hidden)
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[f"mtp.{norm}.weight"] = torch.empty(hidden)
    out = {}
    for name in sorted(tensors):
        shape = tensors[name].shape
        if len(shape) == 1:
            value = torch.randn(shape, generator=g) * 0.2
        else:
            value = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[name] = value.to(dtype).contiguous()
    return out


def per_expert(tensors):
    """Fused expert tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])
    split into the per-expert names released checkpoints store."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            stem, inter = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = value[e, :inter].contiguous()
                out[f"{stem}{e}.up_proj.weight"] = value[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[name] = value
    return out


def stored_per_expert(path):
    """Whether the fixture's checkpoint stores its experts one by one."""
    names = []
    for fname in os.listdir(path):
        if fname.startswith("model") and fname.endswith(".safetensors"):
            names += list(load_file(os.path.join(path, fname)).keys())
    return any(".mlp.experts.0." in n for n in names)


def write_weights(path, head):
    """Puts the head beside the fixture's weights, replacing any `mtp.*` already there."""
    if stored_per_expert(path):
        head = per_expert(head)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        fname = "model-mtp.safetensors"
        save_file(head, os.path.join(path, fname), metadata={"format": "pt"})
        data = json.load(open(index))
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.startswith("mtp.")}
        data["weight_map"].update({k: fname for k in head})
        json.dump(data, open(index, "w"), indent=2)
    else:
        main = os.path.join(path, "model.safetensors")
        tensors = {k: v for k, v in load_file(main).items() if not k.startswith("mtp.")}
        tensors.update(head)
        save_file(tensors, main, metadata={"format": "pt"})


def mtp_forward(text_model, lm_head, head, text_cfg, layer_class, tokens, hidden, start):
    """The head over `tokens` `[T]` and `hidden` `[T, H]` at positions start..start+T-1, with no
    earlier context; returns (logits, y)."""
    f32 = {k: v.float() for k, v in head.items()}
    eps = text_cfg.rms_norm_eps

    def norm(name):
        n = Qwen3_5RMSNorm(text_cfg.hidden_size, eps=eps)
        n.weight.data.copy_(f32[f"mtp.{name}.weight"])
        return n

    layer = layer_class(text_cfg, text_cfg.layer_types.index("full_attention"))
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in f32.items() if k.startswith("mtp.layers.0.")})
    e = norm("pre_fc_norm_embedding")(text_model.embed_tokens(tokens[None]))
    h = norm("pre_fc_norm_hidden")(hidden[None])
    x = torch.cat([e, h], dim=-1) @ f32["mtp.fc.weight"].T
    t = tokens.shape[0]
    positions = torch.arange(start, start + t).view(1, 1, -1).expand(3, 1, -1)
    rope = text_model.rotary_emb(x, positions)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    y = norm("norm")(layer(x, position_embeddings=rope, attention_mask=mask))
    return lm_head(y)[0].float(), y[0]


def add_head(path):
    seed = 1000 + sum(map(ord, os.path.basename(os.path.normpath(path))))
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    text_config_json(config)["mtp_num_hidden_layers"] = 1
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    hf = AutoConfig.from_pretrained(path)
    layer_class, nested_class, flat_class = FAMILIES[hf.model_type]
    nested = not hf.model_type.endswith("_text")
    text_cfg = hf.text_config if nested else hf
    text_cfg._attn_implementation = "eager"
    head = random_head(text_cfg, layer_class, seed, disk_dtype(path))
    write_weights(path, head)

    cls = nested_class if nested else flat_class
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    text_model = model.model.language_model if nested else model.model
    ref_path = os.path.join(path, "reference.safetensors")
    ref = load_file(ref_path)
    prompt = ref["tokens"]
    with torch.no_grad():
        hidden = text_model(input_ids=prompt[None]).last_hidden_state[0]
        logits, y = mtp_forward(text_model, model.lm_head, head, text_cfg, layer_class, prompt[1:], hidden[:-1], 0)
        # One draft step more: the sequence with (argmax, the head's own last y) appended.
        draft = torch.argmax(logits[-1]).view(1)
        chain, _ = mtp_forward(text_model, model.lm_head, head, text_cfg, layer_class, torch.cat([prompt[1:], draft]),
                               torch.cat([hidden[:-1], y[-1:]]), 0)
        chain = chain[-1:]
    ref.update({"mtp_hidden": hidden.contiguous(), "mtp_logits": logits.contiguous(),
                "mtp_chain_logits": chain.contiguous()})
    save_file(ref, ref_path)
    print(path, "mtp head added; draft after the prompt", int(draft), "then", int(torch.argmax(chain[-1])))


if __name__ == "__main__":
    for fixture in sys.argv[1:]:
        add_head(fixture)
