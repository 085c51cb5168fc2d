"""difftune beside diffusers' DreamBooth LoRA scripts for FLUX.1 and Qwen-Image: one base, data and settings.

    python scripts/bench_big_peer.py --peer-dir PEER_DIR [--scenario NAME ...] [--workdir DIR] [--results OUT.jsonl]
    python scripts/bench_big_peer.py --dry-run [--peer-dir PEER_DIR]   # the whole harness on the CPU at toy widths
    python scripts/bench_big_peer.py --table                           # only rewrite the benchmarks page's table

PEER_DIR holds your copies of diffusers' `examples/dreambooth/train_dreambooth_lora_flux.py` and
`train_dreambooth_lora_qwen_image.py` (never copied into this repository: `git show` them out of a diffusers checkout,
as ../shared/peer-bench/README.md says for its script), and optionally `site/`, a folder put first on the peer's
PYTHONPATH (where a torchvision that matches the machine's torch can live without touching the environment).

A scenario runs the peer, then difftune, each as one process of `--steps` steps on the same base (a random-weight
one at the real widths, built once into `--workdir` by make_real_width_base.py; weights' values do not change speed
or memory), the same images (square, at the training size: no resize differs) and the same caption (the peer's
instance prompt; it encodes it once, which difftune's text cache matches), and prints one JSON line per trainer:
in-run seconds per step from the progress bar's timestamps after `--warmup` steps, the process's peak host memory,
and its peak device memory as torch's allocator counted it. Settings both sides share: LoRA rank and alpha 16 on the
peer's default layers, AdamW lr 1e-4 constant without warmup, batch 1, bf16, one process, no sampling, no checkpoints,
no data workers, the same text length (FLUX.1's T5 padded to the base's tokenizer length, 512 as published).

`--dry-run` runs every scenario end to end on the CPU at toy widths (the bundled tiny bases, 64 px, 4 steps, fp32:
bf16 on a CPU without bf16 units is 100x slower per convolution), the peer side where its script is found, so a GPU
lease only measures. Its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import resource
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "peer-big.jsonl"
MARKERS = ("<!-- peer-big:start -->", "<!-- peer-big:end -->")
INSTANCE_PROMPT = "a photo of sks shape"
PROGRESS = {"peer": r"Steps:[^\r\n]*?(\d+)/(\d+) \[", "difftune": r"train:[^\r\n]*?(\d+)/(\d+) \["}
PEAKS_EVERY_S = 0.5  # how often a trainer's process writes its peaks
VERSIONED = ("torch", "diffusers", "transformers", "peft", "accelerate")

FLUX_TARGETS = [  # train_dreambooth_lora_flux.py's default `--lora_layers`
    *("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0"),
    *("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out"),
    *("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
]
QWEN_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]  # train_dreambooth_lora_qwen_image.py's
MODELS = {  # the peer's script, the published base, difftune's shipped job for the family, the tiny base, targets
    "flux": dict(
        script="train_dreambooth_lora_flux.py",
        base="black-forest-labs/FLUX.1-dev",
        config="configs/flux_lora.toml",
        tiny="models/tiny-flux",
        targets=FLUX_TARGETS,
        peer=["--guidance_scale", "1"],  # difftune's default guidance embedding (`model.family_options.guidance`)
    ),
    "qwen_image": dict(
        script="train_dreambooth_lora_qwen_image.py",
        base="Qwen/Qwen-Image",
        config="configs/qwen_image_lora.toml",
        tiny="models/tiny-qwen_image",
        targets=QWEN_TARGETS,
        peer=["--skip_final_inference"],
        # 40 of its 60 blocks: the whole 20B transformer and the 7B text encoder (58 GB) would fill a 64 GB disk
        blocks=40,
    ),
}
# Each trainer's way to less device memory: the peer's flags for smaller cards (8-bit Adam left out: bitsandbytes is
# optional on both sides; the Qwen-Image script's `--offload` keeps its VAE and text encoder in host memory between
# uses, the FLUX.1 one has no such flag), difftune's fp8 frozen weights; both cache latents and checkpoint.
LOW_MEMORY_PEER = ["--gradient_checkpointing", "--cache_latents"]
LOW_MEMORY_DIFFTUNE = ["train.gradient_checkpointing=true", "model.weight_dtype=fp8", "cache.latents=on"]
SCENARIOS = {  # name -> model, resolution, what, peer's own flags, difftune's own overrides
    "flux-1024-bf16": (
        "flux",
        1024,
        "FLUX.1 [dev] LoRA r16, 1024 px, bf16 weights on the device, checkpointed, latents encoded each step",
        ["--gradient_checkpointing"],
        ["train.gradient_checkpointing=true", "cache.latents=off"],
    ),
    "flux-1024-low-memory": (
        "flux",
        1024,
        "FLUX.1 [dev] LoRA r16, 1024 px, each trainer's low-memory mode",
        LOW_MEMORY_PEER,
        LOW_MEMORY_DIFFTUNE,
    ),
    "flux-512-bf16": (
        "flux",
        512,
        "FLUX.1 [dev] LoRA r16, 512 px, bf16 weights on the device, latents encoded each step",
        [],
        ["cache.latents=off"],
    ),
    "qwen-1024-bf16": (
        "qwen_image",
        1024,
        "Qwen-Image (40 of 60 blocks) LoRA r16, 1024 px, bf16 weights on the device, checkpointed, latents encoded "
        "each step",
        ["--gradient_checkpointing"],
        ["train.gradient_checkpointing=true", "cache.latents=off"],
    ),
    "qwen-1024-low-memory": (
        "qwen_image",
        1024,
        "Qwen-Image (40 of 60 blocks) LoRA r16, 1024 px, each trainer's low-memory mode",
        [*LOW_MEMORY_PEER, "--offload"],
        LOW_MEMORY_DIFFTUNE,
    ),
}


def ensure_base(model: str, workdir: Path, dry_run: bool) -> Path:
    """The base both trainers read: the bundled tiny base in a dry run, else the published one's widths with random
    weights, built once (written aside, then renamed)."""
    if dry_run:
        return REPO / MODELS[model]["tiny"] if model != "flux" else tiny_flux_with_clip_positions(workdir)
    base = workdir / model
    if not (base / "model_index.json").is_file():
        partial = workdir / f"{model}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        build = [sys.executable, str(REPO / "scripts" / "make_real_width_base.py"), "--base", MODELS[model]["base"]]
        subprocess.run(
            [*build, "--out", str(partial), "--tokenizers-from", str(REPO / MODELS[model]["tiny"])], check=True
        )
        if model == "flux":  # FLUX.1 [dev]'s T5 tokenizer pads to 512; the tiny one lent here to 32
            settings = partial / "tokenizer_2" / "tokenizer_config.json"
            config = json.loads(settings.read_text(encoding="utf-8"))
            settings.write_text(json.dumps(config | {"model_max_length": 512}), encoding="utf-8")
        partial.rename(base)
    return base


def tiny_flux_with_clip_positions(workdir: Path, positions: int = 77) -> Path:
    """The tiny Flux base with its CLIP text encoder reading 77 positions, as the published one does: the peer's FLUX.1
    script pads CLIP's tokens to 77 whatever the tokenizer says, and the tiny encoder has 32. Its first 32 position
    embeddings are the tiny base's, the rest random."""
    import torch
    from transformers import CLIPTextModel

    base = workdir / f"tiny-flux-clip{positions}"
    if not (base / "model_index.json").is_file():
        shutil.rmtree(base, ignore_errors=True)
        shutil.copytree(REPO / MODELS["flux"]["tiny"], base)
        tiny = CLIPTextModel.from_pretrained(base / "text_encoder")
        tiny.config.max_position_embeddings = positions
        torch.manual_seed(0)
        encoder = CLIPTextModel(tiny.config).to(tiny.dtype)
        weights = tiny.state_dict()
        table = next(name for name in weights if name.endswith("position_embedding.weight"))
        weights[table] = torch.cat([weights[table], encoder.state_dict()[table][weights[table].shape[0] :]])
        encoder.load_state_dict(weights, strict=False)  # the position ids are the new model's own buffer
        encoder.save_pretrained(base / "text_encoder")
        settings = base / "tokenizer" / "tokenizer_config.json"
        config = json.loads(settings.read_text(encoding="utf-8"))
        settings.write_text(json.dumps(config | {"model_max_length": positions, "max_length": positions}), "utf-8")
    return base


def ensure_images(workdir: Path, resolution: int, count: int) -> tuple[Path, Path]:
    """The same square images twice: alone for the peer (its DreamBooth dataset opens every file in its folder), and
    with the instance prompt as each one's caption file for difftune."""
    images, captioned = workdir / f"instance-{resolution}", workdir / f"captioned-{resolution}"
    if not captioned.is_dir():
        from difftune.toy import tiny

        for folder in (images, captioned):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        for index, (image, _) in enumerate(tiny.shape_images(count, seed=0)):
            image = image.resize((resolution, resolution))
            for folder in (images, captioned):
                image.save(folder / f"{index:03d}.png")
            (captioned / f"{index:03d}.txt").write_text(INSTANCE_PROMPT, encoding="utf-8")
    return images, captioned


def peer_command(args, model: str, resolution: int, flags: list[str], base: Path, images: Path, out: Path) -> list:
    script = Path(args.peer_dir) / MODELS[model]["script"]
    tokenizer = base / "tokenizer_2" / "tokenizer_config.json"
    text_length = json.loads(tokenizer.read_text(encoding="utf-8"))["model_max_length"] if model == "flux" else 512
    return [
        str(script),
        *("--pretrained_model_name_or_path", str(base), "--instance_data_dir", str(images)),
        *("--instance_prompt", INSTANCE_PROMPT, "--max_sequence_length", str(text_length)),
        *("--resolution", str(resolution), "--train_batch_size", "1", "--rank", "16", "--lora_alpha", "16"),
        *("--learning_rate", "1e-4", "--lr_scheduler", "constant", "--lr_warmup_steps", "0"),
        *("--max_train_steps", str(args.steps), "--mixed_precision", args.precision, "--seed", "0"),
        *("--output_dir", str(out), "--checkpointing_steps", "1000000000", "--dataloader_num_workers", "0"),
        *("--optimizer", "AdamW", "--report_to", "tensorboard"),
        *MODELS[model]["peer"],
        *flags,
    ]


def difftune_command(args, model: str, resolution: int, overrides: list[str], base: Path, data: Path, out: Path):
    targets = json.dumps(MODELS[model]["targets"])
    return [
        "train",
        "--config",
        str(REPO / MODELS[model]["config"]),
        f"model.base={base}",
        f"data.path={data}",
        f"data.resolution={resolution}",
        *("data.caption_dropout=0", "data.num_workers=0", "data.random_flip=false", "data.buckets=false"),
        *("adapter.kind=lora", "adapter.rank=16", "adapter.alpha=16", "adapter.text_encoder=false"),
        f"adapter.target_modules={targets}",
        *("optim.learning_rate=1e-4", "optim.lr_schedule=constant", "optim.warmup_steps=0", "optim.optimizer=adamw"),
        *(f"train.max_steps={args.steps}", "train.batch_size=1", f"train.mixed_precision={args.precision}"),
        f"train.output_dir={out}",
        *("sample.prompts=[]", "sample.before=false", "cache.text=on", f"cache.dir={out / 'cache'}"),
        *overrides,
    ]


def measured(trainer: str, command: list[str], steps: int, warmup: int, log: Path, python_path: list[str]) -> dict:
    """Run `command` in a child of this script (`--child`, which keeps writing its own peaks) and time its progress
    bar. Once the bar shows the last step the child is stopped: the end of a run (saving; the peer's FLUX.1 script
    loads the whole pipeline again) is neither timed nor counted in the peaks, and costs no GPU minutes."""
    peaks = log.with_suffix(".peaks.json")
    peaks.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["HF_HOME"] = str(log.with_suffix(".hf-home"))  # no user accelerate config or hub cache leaks in
    env["PYTHONPATH"] = os.pathsep.join([*python_path, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    child = [sys.executable, __file__, "--child", trainer, "--peaks", str(peaks), "--", *command]
    progress, seen, start = re.compile(PROGRESS[trainer].encode()), {}, time.perf_counter()
    with subprocess.Popen(child, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        with log.open("wb") as out:
            while chunk := os.read(process.stdout.fileno(), 1 << 16):
                out.write(chunk)
                for match in progress.finditer(chunk):  # tqdm redraws with "\r": match inside each chunk as it comes
                    if int(match[2]) == steps:
                        seen.setdefault(int(match[1]), time.perf_counter() - start)
                if steps in seen:
                    time.sleep(2 * PEAKS_EVERY_S)  # a write of the peaks after the last step
                    process.kill()
                    break
        process.wait()
    if steps not in seen:
        tail = log.read_bytes()[-3000:].decode(errors="replace")
        raise RuntimeError(f"{trainer} exited with {process.returncode} before step {steps}; log {log}:\n{tail}")
    first = max(warmup, 1)
    if first not in seen:
        raise RuntimeError(f"{trainer}: its progress bar never showed step {first}; log {log}")
    return {
        "sec_per_step_inrun": round((seen[steps] - seen[first]) / (steps - first), 4),
        "to_last_step_s": round(seen[steps], 1),
        **json.loads(peaks.read_text(encoding="utf-8")),
    }


def run_scenario(name: str, args, workdir: Path, results: Path | None) -> None:
    """Both trainers' runs of scenario `name`, each record printed and appended to `results` once measured."""
    model, resolution, what, peer_flags, difftune_overrides = SCENARIOS[name]
    resolution = 64 if args.dry_run else resolution
    base = ensure_base(model, workdir, args.dry_run)
    images, captioned = ensure_images(workdir, resolution, count=8)
    script = Path(args.peer_dir or "") / MODELS[model]["script"]
    outputs = {"peer": workdir / "peer-out", "difftune": workdir / "difftune-out"}
    sides = {
        "peer": peer_command(args, model, resolution, peer_flags, base, images, outputs["peer"])
        if script.is_file()
        else None,
        "difftune": difftune_command(args, model, resolution, difftune_overrides, base, captioned, outputs["difftune"]),
    }
    site = Path(args.peer_dir or "") / "site"
    for trainer, command in sides.items():
        if command is None:
            print(f"{name}: no {script} (--peer-dir): the peer's side is left out", file=sys.stderr)
            continue
        shutil.rmtree(outputs[trainer], ignore_errors=True)
        print(f"{name}: {trainer}", file=sys.stderr, flush=True)
        python_path = [str(site)] if trainer == "peer" and site.is_dir() else []
        result = measured(trainer, command, args.steps, args.warmup, workdir / f"{name}-{trainer}.log", python_path)
        record = {
            "scenario": name,
            "trainer": "diffusers-dreambooth" if trainer == "peer" else "difftune",
            "what": what,
            "model": model,
            "resolution": resolution,
            "precision": args.precision,
            "steps": args.steps,
            "warmup": args.warmup,
            "dry_run": args.dry_run,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": command[1:] if trainer == "peer" else command,
            **result,
            "versions": versions(),
        }
        print(json.dumps(record), flush=True)
        if results:
            with results.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def child(trainer: str, peaks: Path, command: list[str]) -> None:
    """Run one trainer in this process, so that its peaks are this process's, written as it runs."""
    import threading

    import torch

    def write_peaks() -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        found = {
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "device_peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
            "device_peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1) if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
        }
        peaks.with_suffix(".partial").write_text(json.dumps(found), encoding="utf-8")
        peaks.with_suffix(".partial").replace(peaks)

    def keep_writing() -> None:
        while True:
            write_peaks()
            time.sleep(PEAKS_EVERY_S)

    threading.Thread(target=keep_writing, daemon=True).start()
    if trainer == "peer":  # the script as `__main__`, its folder on sys.path, torchvision importable
        declare_torchvision_ops()
        sys.argv = command
        sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
        run = lambda: runpy.run_path(command[0], run_name="__main__")  # noqa: E731
    else:
        from difftune.cli import main

        sys.argv = ["difftune", *command]
        run = main
    try:
        code = run()
    except SystemExit as exit:
        code = exit.code
    write_peaks()
    sys.exit(code if isinstance(code, int) else 0)


def declare_torchvision_ops() -> None:
    """PyPI's torchvision is built against CUDA torch; beside a CPU torch its ops library does not load and its import
    dies registering fake kernels for `torchvision::nms`. The scripts use its pure-Python transforms alone, so where
    the ops cannot load, declare the two schemas its import looks up (never called)."""
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    for ops in Path(spec.origin).parent.glob("_C*.so"):
        try:
            torch.ops.load_library(str(ops))
            return
        except OSError:
            pass
    library = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    declare_torchvision_ops.library = library  # kept alive: dropping it drops the schemas


def markdown_table(records: list[dict]) -> str:
    """Per scenario, the newest sitting on a GPU: both trainers' in-run s/step and peaks, the speed ratio."""
    lines = [
        "| scenario | device | date | peer s/step | difftune s/step | speed ratio | peer device peak GiB | "
        "difftune device peak GiB | peer host peak GiB | difftune host peak GiB | command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    newest: dict[str, dict[str, dict]] = {}
    for record in records:
        if not record["dry_run"]:
            newest.setdefault(record["scenario"], {})[record["trainer"]] = record
    for name in SCENARIOS:
        pair = newest.get(name, {})
        peer, ours = pair.get("diffusers-dreambooth"), pair.get("difftune")
        if not (peer and ours):
            continue

        def gib(record: dict, key: str) -> str:
            return f"{record[key] / 1024:.1f}" if record.get(key) is not None else "-"

        lines.append(
            f"| {ours['what']} | {ours['device']} | {ours['date'][:10]} | {peer['sec_per_step_inrun']:.3g} | "
            f"{ours['sec_per_step_inrun']:.3g} | {peer['sec_per_step_inrun'] / ours['sec_per_step_inrun']:.2f}x | "
            f"{gib(peer, 'device_peak_reserved_mib')} | {gib(ours, 'device_peak_reserved_mib')} | "
            f"{gib(peer, 'peak_rss_mib')} | {gib(ours, 'peak_rss_mib')} | "
            f"`python scripts/bench_big_peer.py --peer-dir PEER --scenario {name}` |"
        )
    return "\n".join(lines)


def write_table(results: Path = RESULTS, benchmarks: Path = REPO / "docs" / "benchmarks.md") -> None:
    records = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines() if line.strip()]
    text = benchmarks.read_text(encoding="utf-8")
    start, end = (text.index(marker) for marker in MARKERS)
    benchmarks.write_text(text[:start] + f"{MARKERS[0]}\n{markdown_table(records)}\n" + text[end:], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-dir", help="the folder holding your copies of the two DreamBooth LoRA scripts")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="default: all, in order")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-big-peer")
    parser.add_argument("--results", type=Path, help=f"the JSONL to append to (default {RESULTS}; none in a dry run)")
    parser.add_argument("--steps", type=int, help="steps per run (default 20; 4 in a dry run)")
    parser.add_argument("--warmup", type=int, help="steps left out of the timing (default 5; 1 in a dry run)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny bases on the CPU, 64 px, fp32")
    parser.add_argument("--table", action="store_true", help="only rewrite the benchmarks page's table from the JSONL")
    parser.add_argument("--child", choices=("peer", "difftune"), help=argparse.SUPPRESS)
    parser.add_argument("--peaks", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.peaks, args.command)
    if not args.table:
        args.steps = args.steps or (4 if args.dry_run else 20)
        args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
        args.precision = "no" if args.dry_run else "bf16"
        if not 0 <= args.warmup < args.steps - 1:
            parser.error(f"--warmup {args.warmup} leaves fewer than two timed steps of --steps {args.steps}")
        if args.peer_dir and not Path(args.peer_dir).is_dir():
            parser.error(f"--peer-dir {args.peer_dir}: not a folder")
        args.workdir.mkdir(parents=True, exist_ok=True)
        for name in args.scenario or SCENARIOS:
            run_scenario(name, args, args.workdir, args.results or (None if args.dry_run else RESULTS))
    if args.table or (not args.dry_run and (args.results or RESULTS) == RESULTS):
        write_table()


if __name__ == "__main__":
    main()
