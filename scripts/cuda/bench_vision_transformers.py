#!/usr/bin/env python3
"""transformers' side of `strata bench --image-size`: the same square image through
Qwen2VLImageProcessor and a random-weight Qwen3_5VisionModel of a synthetic shape's tower (both read
crates/model/src/synthetic_shapes.json and use the release's processor settings), in bf16 with
SDPA attention. Prints one JSON line per attention implementation:
  {"kind": "vision", "shape": ..., "attention": "sdpa", "image_size": N, "patches": ..., "image_tokens": ...,
   "preprocess_ms": ..., "encode_ms_p50": ...}
Usage: bench_vision_transformers.py --shape qwen3.5-4b --image-size 1024 [--device cuda] [--attention sdpa,eager]
"""
import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

SHAPES = json.loads((pathlib.Path(__file__).parents[2] / "crates/model/src/synthetic_shapes.json").read_text())


def image(size):
    """strata bench's image: red along x, green along y, blue (x + y) mod 256."""
    x, y = np.meshgrid(np.arange(size), np.arange(size))
    return np.stack([x * 255 // size, y * 255 // size, (x + y) % 256], -1).astype(np.uint8)


def prepare(rgb):
    """The processor's pixel values and grid, and its milliseconds; without PIL (which the slow
    processor needs), values of the same shape: the tower's time does not depend on them."""
    try:
        from PIL import Image
        from transformers import Qwen2VLImageProcessor
    except ImportError:
        side = rgb.shape[0] // 16 // 2 * 2
        return torch.randn(side * side, 3 * 2 * 16 * 16), torch.tensor([[1, side, side]]), None
    processor = Qwen2VLImageProcessor(size={"shortest_edge": 65_536, "longest_edge": 16_777_216}, patch_size=16,
                                      merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    start = time.perf_counter()
    inputs = processor(images=[Image.fromarray(rgb)], return_tensors="pt")
    return inputs["pixel_values"], inputs["image_grid_thw"], (time.perf_counter() - start) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-4b")
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="sdpa")
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    v = shape["vision"]
    pixels, grid, preprocess_ms = prepare(image(a.image_size))
    pixels, grid = pixels.to(a.device, torch.bfloat16), grid.to(a.device)
    for attention in a.attention.split(","):
        cfg = Qwen3_5VisionConfig(depth=v["depth"], hidden_size=v["hidden"], intermediate_size=v["intermediate"],
                                  num_heads=v["heads"], out_hidden_size=shape["hidden"], patch_size=16,
                                  num_position_embeddings=2304)
        cfg._attn_implementation = attention
        torch.manual_seed(0)
        with torch.device(a.device):
            model = Qwen3_5VisionModel(cfg).to(torch.bfloat16).eval()
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

        def encode():
            sync()
            start = time.perf_counter()
            out = model(pixels, grid_thw=grid)
            sync()
            return (time.perf_counter() - start) * 1e3, out

        with torch.no_grad():
            for _ in range(2):
                encode()
            times = [encode()[0] for _ in range(10)]
            merged = encode()[1].pooler_output
        print(json.dumps({"kind": "vision", "shape": a.shape, "attention": attention, "image_size": a.image_size,
                          "patches": int(grid.prod()), "image_tokens": merged.shape[0],
                          "preprocess_ms": preprocess_ms, "encode_ms_p50": statistics.median(times)}), flush=True)
        del model
        if a.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
