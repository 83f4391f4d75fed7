"""``pdserve bench images``: what the router spends on a chat prompt's image before the engines see it, the first
time an image comes and again (a conversation sends its images with every turn), in one process.

For each image size, an image as a client sends it (a PNG or JPEG data URL), through the router's own
preparation (``router.images.ImageProcessor.prepare``: base64, decoding, the model's image processor, the span,
the pixels' digest):

* first sight: a fresh processor each repetition (its cache empty), as without ``--mm-processor-cache-gb``;
* again: the same bytes a second time, from the processor cache.

Medians over ``--repeat`` repetitions, the processed pixels' size beside them. The model is an image-text folder
given by ``--model`` (its router side alone: no weights are read); without one, a folder made here with
SmolVLM-256M's processing (images to a longest side of 2,048 pixels in tiles of 512, 64 tokens a tile) around
the bundled SmolLM2's tokenizer with SmolVLM's image tokens added, which is what SmolVLM's tokenizer is.

    pdserve bench images --json ops/bench/results/images-cpu-2026-12-06.json
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZES = ((480, 640), (1080, 1920), (3024, 4032))


def smolvlm_folder(folder: Path) -> Path:
    """SmolVLM-256M's router side: its config's vision and scale, its image processor's settings, SmolLM2's
    tokenizer with SmolVLM's added tokens, the default model's chat template."""
    from transformers import AutoTokenizer, LlamaConfig, SmolVLMConfig, SmolVLMVisionConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from common.model.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid]})
    tokenizer.chat_template = (
        "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: {% if message['content'] is "
        "string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == "
        "'text' %}{{ part['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
        "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
    tokenizer.save_pretrained(str(folder))
    vision = SmolVLMVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=12, image_size=512, patch_size=16)
    config = SmolVLMConfig(text_config=LlamaConfig(vocab_size=len(tokenizer)).to_dict(), vision_config=vision.to_dict(),
                           scale_factor=4, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    config.to_json_file(str(folder / "config.json"))
    SmolVLMImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}).save_pretrained(
        str(folder))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    return folder


def data_url(height: int, width: int, fmt: str, seed: int) -> str:
    """A photo-like image (smooth gradients and noise) of this size, as a client sends it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def measure(folder: Path, url: str, repeat: int) -> dict[str, Any]:
    """Medians of ``prepare`` on first sight (a fresh processor each time) and again (its cache)."""
    from transformers import AutoTokenizer

    from router.images import ImageRef, ModelImages

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": "What is in this picture?"}]}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    refs = [ImageRef("messages.0.content.0.image_url", url)]
    first, again = [], []
    for _ in range(repeat):
        processor = ModelImages.from_model_dir(folder, tokenizer).processor
        if processor is None:
            raise SystemExit(f"{folder}: the router takes no images for this model")
        start = time.perf_counter()
        expanded, [image] = processor.prepare(ids, refs)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert processor.prepare(ids, refs) == (expanded, [image])
        again.append(time.perf_counter() - start)
        assert processor.cache.hits == 1
    return {"encoded_bytes": len(url), "pixels_mib": len(image.pixel_values) / (1 << 20),
            "processed": [image.height, image.width], "image_tokens": image.length,
            "first_ms": 1e3 * statistics.median(first), "again_ms": 1e3 * statistics.median(again)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an image-text model folder (default: SmolVLM-256M's "
                                                      "processing around the bundled tokenizer)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default=",".join(f"{h}x{w}" for h, w in SIZES),
                        help="the images' sizes, HEIGHTxWIDTH, comma-separated (default: %(default)s)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-images-") as tmp:
        folder = Path(args.model) if args.model else smolvlm_folder(Path(tmp))
        rows = []
        sizes = [tuple(int(side) for side in size.split("x")) for size in args.sizes.split(",")]
        for k, (height, width) in enumerate(sizes):
            for fmt in ("JPEG", "PNG"):
                row = {"size": [height, width], "format": fmt,
                       **measure(folder, data_url(height, width, fmt, k), args.repeat)}
                rows.append(row)
                print(f"{height:5d} x {width:<5d} {fmt:4s} {row['encoded_bytes'] / 1e6:6.2f} MB sent -> "
                      f"{row['processed'][0]} x {row['processed'][1]}, {row['image_tokens']} tokens, "
                      f"{row['pixels_mib']:.1f} MiB of pixels: first {row['first_ms']:8.1f} ms, again (cached) "
                      f"{row['again_ms']:6.1f} ms", flush=True)
    result = {
        "date": dt.date.today().isoformat(),
        "command": "pdserve bench images " + " ".join(argv or []),
        "model": args.model or "SmolVLM-256M's processing (generated)",
        "environment": {"python": platform.python_version(), "machine": platform.machine()},
        "repeat": args.repeat, "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0
