"""Write the bundled tiny base model and example images: `python scripts/make_tiny_base.py`.

The base (models/tiny-sd) is a random-init Stable Diffusion 1.x-architecture pipeline built from
diffusers/transformers config classes (see difftune/tiny.py), saved in fp32 (transformers 5 loads a
model in its saved dtype, so an fp16 text encoder beside an fp32 UNet breaks a plain CPU
`from_pretrained`; at this size fp32 costs 3.6 MB). It lets the default job
and the tests run with no downloads; it has learned nothing yet. The examples (examples/shapes)
are synthetic 32 px renders of colored shapes captioned `a <color> <shape>`. Deterministic by seed.
"""

import argparse
import shutil
from pathlib import Path

from difftune.tiny import build_pipeline, shape_images, write_caption_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/tiny-sd")
    parser.add_argument("--examples-dir", default="examples/shapes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_dir, examples_dir = Path(args.model_dir), Path(args.examples_dir)
    shutil.rmtree(model_dir, ignore_errors=True)
    build_pipeline(args.seed).save_pretrained(model_dir, safe_serialization=True)
    shutil.rmtree(examples_dir, ignore_errors=True)
    write_caption_folder(examples_dir, shape_images(15, seed=args.seed))
    print(f"wrote {model_dir} and {examples_dir}")


if __name__ == "__main__":
    main()
