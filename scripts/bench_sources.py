"""Reading training data where it lives: a folder, tar shards, parquet and a saved dataset on local disk, and the
shards and parquet on an S3-compatible server (moto's, started here on loopback: its rows measure difftune's reads
through s3fs, not a real store's latency).

    python scripts/bench_sources.py [--images 1000] [--side 512] [--jsonl benchmarks/sources.jsonl]

Per source, one JSON line: the scan's seconds (list, hash and decode-check every image: what runs before the first
step) and one uncached pass over every example as training draws them (`CaptionedImages`, in a shuffled order,
decoded, cut and flipped, in one process), in images per second.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftune.config import DataConfig
from difftune.data.dataset import CaptionedImages, scan_examples, training_sizes


def photo_like(rng: np.random.Generator, side: int) -> bytes:
    """A JPEG of smooth random color (about a photo's size at quality 90)."""
    coarse = rng.integers(0, 256, (side // 32, side // 32, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC)
    noise = rng.integers(-12, 13, (side, side, 3))
    image = Image.fromarray(np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_sources(root: Path, images: int, side: int, per_shard: int = 100) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    records = [(f"{i:06d}", photo_like(rng, side), f"a photo number {i}") for i in range(images)]
    folder = root / "folder"
    folder.mkdir()
    for key, data, caption in records:
        (folder / f"{key}.jpg").write_bytes(data)
        (folder / f"{key}.txt").write_text(caption)
    shards = root / "shards"
    shards.mkdir()
    for number, start in enumerate(range(0, images, per_shard)):
        with tarfile.open(shards / f"train-{number:04d}.tar", "w") as tar:
            for key, data, caption in records[start : start + per_shard]:
                for name, payload in ((f"{key}.jpg", data), (f"{key}.txt", caption.encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    parquet = root / "parquet"
    parquet.mkdir()
    table = pa.table({"jpg": [data for _, data, _ in records], "caption": [caption for _, _, caption in records]})
    pq.write_table(table, parquet / "train-0000.parquet", row_group_size=per_shard)
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    rows = {
        "image": [{"bytes": data, "path": f"{key}.jpg"} for key, data, _ in records],
        "text": [caption for _, _, caption in records],
    }
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(root / "dataset"))
    return {"folder": folder, "shards": shards, "parquet": parquet, "dataset": root / "dataset"}


def measure(source: str, path: str, side: int) -> dict:
    config = DataConfig(path=path, resolution=side // 2, random_flip=True, crop="random")
    start = time.perf_counter()
    examples, bad = scan_examples(config)
    scanned = time.perf_counter() - start
    assert not bad, bad[:3]
    dataset = CaptionedImages(
        examples,
        config,
        lambda captions: {"ids": torch.zeros(len(captions), 1)},
        train_seed=0,
        sizes=training_sizes(examples, config),
    )
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(0)).tolist()  # as training draws
    start = time.perf_counter()
    for index in order:
        dataset[0, index]
    read = time.perf_counter() - start
    return {
        "source": source,
        "images": len(examples),
        "side": side,
        "scan_s": round(scanned, 2),
        "scan_images_per_s": round(len(examples) / scanned, 1),
        "read_images_per_s": round(len(examples) / read, 1),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--jsonl", type=Path, help="append the lines here too")
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
        }
    )
    import fsspec

    s3 = fsspec.filesystem("s3")
    s3.mkdir("bench")
    with tempfile.TemporaryDirectory() as work:
        sources = write_sources(Path(work), args.images, args.side)
        s3.put(f"{sources['shards']}/", "bench/shards/", recursive=True)
        s3.put(f"{sources['parquet']}/", "bench/parquet/", recursive=True)
        paths = {name: str(path) for name, path in sources.items()} | {
            "shards on S3 (moto)": "s3://bench/shards",
            "parquet on S3 (moto)": "s3://bench/parquet",
        }
        for name, path in paths.items():
            line = json.dumps(measure(name, path, args.side))
            print(line, flush=True)
            if args.jsonl:
                with args.jsonl.open("a") as file:
                    file.write(line + "\n")
    server.stop()


if __name__ == "__main__":
    sys.exit(main())
