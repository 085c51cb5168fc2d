"""The `difftune` command: parse, load the config, call one library function."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import ValidationError

from difftune.config import (
    TRAINING_ONLY_SAMPLE_FIELDS,
    Config,
    SampleConfig,
    describe_errors,
    load_config,
)
from difftune.errors import ERROR_PREFIX, DifftuneError
from difftune.files import refuse_folder_target
from difftune.progress import phase
from difftune.training.metrics import METRICS_FILE
from difftune.training.preflight import check_before_start
from difftune.training.run_requests import ASKED, ask
from difftune.webui.form import parse_adapter_spec


def _keys_help() -> str:
    """The config's keys by section, one short paragraph each; their meanings and defaults are in the docs' config
    reference (generated from the same schema), and `difftune config` prints them resolved."""
    lines = [
        "config keys, set in the TOML file or as section.key=value overrides (what each means, and its default: the "
        "Config reference, docs/reference/config.md; `difftune config --config FILE` prints every key as resolved):"
    ]
    for section, section_field in Config.model_fields.items():
        keys = ", ".join(section_field.annotation.model_fields)
        lines.append(textwrap.fill(f"[{section}] {keys}", width=110, initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def _with_detected_family(config: Config) -> Config:
    """`config` with `model.family = "auto"` resolved to the family its base is read as (a pipeline folder's class, a
    single file's keys, a kept hub id), as a run records it; left `auto` where the base cannot be read here."""
    if config.model.family != "auto":
        return config
    from difftune.families import family_of

    try:
        family = family_of(config.model).name
    except DifftuneError as err:
        print(f'# model.family stays "auto": {err}', file=sys.stderr)
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"family": family})})


def _parse_bool(text: str) -> bool:
    """`true`/`false` (as in TOML; also yes/no, on/off, 1/0): argparse's `type=bool` reads "false" as True."""
    words = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    if text.strip().lower() not in words:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return words[text.strip().lower()]


def _sample_fields() -> dict:
    return {n: f for n, f in SampleConfig.model_fields.items() if n not in TRAINING_ONLY_SAMPLE_FIELDS}


# The config's text is about the prompts drawn at the end of a run; here they are what the command draws.
PROMPT_HELP = "a prompt to draw (repeatable); with --control, each is drawn from those control images"


def _add_sample_options(parser: argparse.ArgumentParser) -> None:
    """One option per `[sample]` field that applies outside training, from the schema: `--steps`,
    `--guidance-scale`, `--prompt` (repeatable)..."""
    for name, field in _sample_fields().items():
        flag = "--prompt" if name == "prompts" else "--" + name.replace("_", "-")
        described = PROMPT_HELP if name == "prompts" else field.description
        options = {"dest": f"sample_{name}", "help": described, "default": None}
        annotation = field.annotation
        if get_origin(annotation) is Literal:
            options["choices"] = get_args(annotation)
        else:
            options["metavar"] = flag[2:].upper()
            if get_origin(annotation) is list:
                options["action"] = "append"
            else:
                value_type = next((a for a in get_args(annotation) if a is not type(None)), annotation)
                options["type"] = _parse_bool if value_type is bool else value_type
        parser.add_argument(flag, **options)


def _sample_config(args: argparse.Namespace) -> SampleConfig:
    values = {name: getattr(args, f"sample_{name}") for name in _sample_fields()}
    mask = {"mask": args.mask} if getattr(args, "mask", None) else {}
    if (getattr(args, "control", None) or mask) and values["prompts"]:
        values["prompts"] = [{"prompt": prompt, "controls": args.control, **mask} for prompt in values["prompts"]]
    try:
        return SampleConfig.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as err:
        raise DifftuneError(describe_errors("difftune sample", err, section="sample")) from None


def _command(commands, name: str, summary: str, **options) -> argparse.ArgumentParser:
    """A subcommand whose summary is both its line in `difftune --help` and the first line of its own `--help`."""
    return commands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".", **options)


def _job_command(commands, name: str, summary: str) -> argparse.ArgumentParser:
    """A command that takes a job: --config and section.key=value overrides."""
    command = _command(
        commands, name, summary, epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    command.add_argument("--config", help="TOML job file; omitted: all defaults")
    command.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="overrides, e.g. train.max_steps=200"
    )
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difftune",
        description="Fine-tune diffusion models (images and video: SD, SDXL, SD3, Flux, "
        "FLUX.2, Qwen-Image, Z-Image, Wan and more) with LoRA, DoRA, LoHa/LoKr, textual inversion or fully. "
        "Several GPUs: accelerate launch scripts/train.py with the same arguments.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in (("train", "train a job"), ("config", "print the resolved config of a job as TOML")):
        _job_command(commands, name, summary)
    commands.choices["train"].add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue from the latest complete checkpoint in train.output_dir (auto) or a given one",
    )
    commands.choices["train"].add_argument(
        "--quiet",
        action="store_true",
        help="no line per long step and no bars: warnings, errors and the last lines (log.quiet)",
    )
    find_batch = _job_command(
        commands,
        "find-batch",
        "find the largest batch size that fits in memory, and the accumulation for "
        "train.global_batch_size; prints one JSON line",
    )
    find_batch.add_argument(
        "--max-memory-gb",
        type=float,
        help="memory budget (default: free CUDA memory, or available RAM on the CPU, less --margin)",
    )
    find_batch.add_argument(
        "--margin", type=float, default=0.1, help="fraction of the free memory left unused (default 0.1)"
    )
    find_batch.add_argument("--max-batch", type=int, default=64, help="largest batch size tried (default 64)")
    find_batch.add_argument("--steps", type=int, default=2, help="optimizer steps per trial (default 2)")
    find_batch.add_argument("--num-processes", type=int, default=1, help="processes the job will train on (default 1)")
    find_batch.add_argument("--write", action="store_true", help="save the batch size (and global batch) into --config")
    find_lr = _job_command(
        commands,
        "find-lr",
        "learning-rate range test on a throwaway copy of the job: writes a plot and a suggested "
        "rate; prints one JSON line",
    )
    find_lr.add_argument("--start-lr", type=float, default=1e-7, help="first rate of the sweep (default 1e-7)")
    find_lr.add_argument("--end-lr", type=float, default=1.0, help="last rate of the sweep (default 1)")
    find_lr.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep (default 100)")
    find_lr.add_argument(
        "--out", type=Path, help="folder for lr_range.png and lr_range.json (default: <train.output_dir>/find-lr)"
    )
    find_lr.add_argument("--write", action="store_true", help="save the suggested optim.learning_rate into --config")

    plan = _job_command(
        commands,
        "plan",
        "predict the job's peak device memory and host RAM before loading any weight, by what holds "
        "them; with budgets, the settings that fit, as overrides",
    )
    plan.add_argument("--device-memory", metavar="SIZE", help="the GPU memory to fit, e.g. 12GB or 24GiB")
    plan.add_argument("--host-memory", metavar="SIZE", help="the RAM to fit, e.g. 32GB")
    plan.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help="where the job will train (default: CUDA if this "
        "machine has it or --device-memory names a GPU's, else the CPU)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON line instead of the table")

    adapter_help = "an adapter file (diffusers or kohya layout), optionally with a scale: FILE[:SCALE]; repeatable"
    merge = _command(commands, "merge", "merge adapters into the base model and save it")
    merge.add_argument("--base", required=True, help="base model: diffusers folder, hub id or .safetensors")
    merge.add_argument("--adapter", required=True, action="append", type=parse_adapter_spec, help=adapter_help)
    merge.add_argument("--out", required=True, type=Path, help="output diffusers pipeline folder")
    merge.add_argument(
        "--single-file", action="store_true", help="also write out/model.safetensors in the original layout"
    )
    merge.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="dtype of the saved weights")
    merge.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    convert = _command(commands, "convert", "rewrite an adapter in the diffusers or kohya layout")
    convert.add_argument("source", type=Path, help="adapter file to read (either layout)")
    convert.add_argument("target", type=Path, help="adapter file to write")
    convert.add_argument("--to", required=True, choices=("kohya", "diffusers"), help="layout to write")
    convert.add_argument("--base", help="base model, to read a kohya file's module names (default: from its metadata)")

    average = _command(commands, "average", "average adapter files (e.g. snapshots of one run) into one")
    average.add_argument("adapters", nargs="+", type=Path, help="adapter files, oldest first (either layout)")
    average.add_argument("--out", required=True, type=Path, help="adapter file to write")
    average.add_argument(
        "--weights",
        choices=("uniform", "linear", "exponential"),
        default="uniform",
        help="equal weights, growing linearly, or doubling with each newer file",
    )
    average.add_argument("--to", choices=("diffusers", "kohya"), default="diffusers", help="layout to write")
    average.add_argument("--base", help="base model, to read kohya files' module names (default: from their metadata)")

    resize = _command(commands, "resize", "resize a LoRA to a lower rank by SVD of each layer's change")
    resize.add_argument("source", type=Path, help="LoRA file to read (either layout, any tool's)")
    resize.add_argument("target", type=Path, help="LoRA file to write")
    resize.add_argument("--rank", type=int, help="the most ranks a layer keeps")
    resize.add_argument(
        "--keep-fro",
        type=float,
        help="keep the fewest ranks holding this share of each layer's change (its Frobenius norm; e.g. 0.9)",
    )
    resize.add_argument("--to", choices=("diffusers", "kohya"), help="layout to write (default: the source's)")
    resize.add_argument("--base", help="base model, to read a kohya file's module names (default: from its metadata)")
    resize.add_argument("--report", type=Path, help="write each layer's ranks and the norm it kept here (JSON)")

    push = _command(
        commands, "push", "upload a run's output folder (files, model card, samples) to the Hugging Face Hub"
    )
    push.add_argument("folder", type=Path, help="the run's output folder (train.output_dir)")
    push.add_argument("repo_id", help="the model repository, e.g. your-name/my-lora (made if missing)")
    push.add_argument("--private", action="store_true", help="make the repository private if it is made")
    push.add_argument(
        "--with-checkpoints", action="store_true", help="upload checkpoints/ and snapshots/ too (kept back otherwise)"
    )

    caption = _command(
        commands,
        "caption",
        "caption a folder's images with a vision-language model (a .txt beside each, or metadata.jsonl)",
    )
    caption.add_argument("folder", type=Path, help="the folder of images (and its N_name subfolders)")
    caption.add_argument(
        "--model",
        required=True,
        help="local folder or hub id of a vision-language model transformers loads natively (Qwen2.5-VL, Qwen3-VL, "
        "Florence-2...)",
    )
    caption.add_argument(
        "--prompt",
        help="what the model is asked (default: one sentence for a chat model; Florence-2's <MORE_DETAILED_CAPTION>)",
    )
    caption.add_argument("--metadata", action="store_true", help="write the folder's metadata.jsonl, not .txt files")
    caption.add_argument(
        "--caption-extension", default=".txt", help="caption files' extension (data.caption_extension)"
    )
    caption.add_argument("--overwrite", action="store_true", help="caption images that have a caption already too")
    caption.add_argument("--batch-size", type=int, default=4, help="images per model call")
    caption.add_argument("--max-new-tokens", type=int, default=77, help="the longest caption, in tokens")
    caption.add_argument("--device", help="where the model runs (default: a GPU if present, else the CPU)")

    extract = _command(commands, "extract", "extract a LoRA from a full fine-tune (SVD of each layer's change)")
    extract.add_argument("--base", required=True, help="the model the fine-tune started from (folder or hub id)")
    extract.add_argument("--tuned", required=True, help="the fine-tuned model (e.g. a run's model/ folder)")
    extract.add_argument("--out", required=True, type=Path, help="LoRA file to write")
    extract.add_argument("--rank", type=int, help="the most ranks a layer keeps")
    extract.add_argument(
        "--keep-fro", type=float, help="keep the fewest ranks holding this share of each layer's change (its norm)"
    )
    extract.add_argument("--to", choices=("diffusers", "kohya"), default="diffusers", help="layout to write")
    extract.add_argument(
        "--min-difference",
        type=float,
        default=1e-6,
        help="a layer none of whose weights moved more than this is left out",
    )
    extract.add_argument("--device", help="where the SVDs run (default: a GPU if present, else the CPU)")
    extract.add_argument(
        "--all-layers",
        action="store_true",
        help="every changed linear and convolution layer, not only those the family's LoRAs adapt (diffusers layout)",
    )
    extract.add_argument("--report", type=Path, help="write each layer's ranks and the norm it kept here (JSON)")

    request = _command(
        commands, "request", "ask a running job to draw its sample prompts or save now, at its next step; it goes on"
    )
    request.add_argument(
        "what", choices=ASKED, help="sample: preview samples of its sample.prompts; save: a checkpoint and a snapshot"
    )
    request.add_argument("output_dir", type=Path, help="the job's train.output_dir")

    sample = _command(commands, "sample", "text-to-image samples from a base model and adapters")
    sample.add_argument("--base", required=True, help="base model: diffusers folder, hub id or .safetensors")
    sample.add_argument("--adapter", action="append", default=[], type=parse_adapter_spec, help=adapter_help)
    sample.add_argument("--out", required=True, type=Path, help="folder for the PNGs (clips: MP4) and grid.png")
    sample.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="the dtype every part loads and draws in (default: bf16 on a GPU, fp32 on a CPU)",
    )
    sample.add_argument(
        "--control",
        action="append",
        default=[],
        help="an edit base's control image, or the one a ControlNet (--adapter a run's controlnet folder) draws from, "
        "for every prompt (repeat for several, in order)",
    )
    sample.add_argument(
        "--seconds",
        type=float,
        help="a sound base's sounds, in seconds (default: as long as the adapter's run trained them, else the "
        "family's 30)",
    )
    sample.add_argument(
        "--mask",
        help="an inpainting mask, white where the base draws, for every prompt: it paints into the first --control "
        "(an inpainting base, Z-Image, FLUX.2 [klein])",
    )
    _add_sample_options(sample)

    evaluate = _command(
        commands,
        "eval",
        "judge samples of the tiny shapes base (and of an adapter on it): seen prompts, held-out concept, forgetting",
    )
    evaluate.add_argument(
        "--base", default="models/tiny-sd", help="a base trained on the shapes (default: the bundled one)"
    )
    evaluate.add_argument("--adapter", type=Path, help="adapter to score after the base (either layout)")
    evaluate.add_argument(
        "--concept",
        help="the held-out concept the adapter teaches: a color for a shapes base (default purple), a pitch for a tone "
        "base (default shrill)",
    )
    evaluate.add_argument(
        "--concept-word",
        default="",
        help="what the adapted model's concept prompts say instead of "
        "the color, e.g. an embedding's token (default: the color)",
    )
    evaluate.add_argument("--samples-per-prompt", type=int, default=8, help="images drawn of each prompt (default 8)")
    evaluate.add_argument("--seed", type=int, default=1000, help="sample k of every prompt uses seed + k")
    evaluate.add_argument("--steps", type=int, default=20, help="denoising steps")
    evaluate.add_argument(
        "--guidance-scale", type=float, default=3.0, help="classifier-free guidance of the samples (default 3)"
    )
    evaluate.add_argument("--out", type=Path, help="also write the JSON report here")
    evaluate.add_argument("--quiet", action="store_true", help="no line on stderr as each prompt starts")

    ui = _command(commands, "ui", "the web UI: configure, launch and watch jobs, sample, export")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind; anything but this machine needs --auth")
    ui.add_argument("--port", type=int, default=7860, help="port to serve on (default 7860)")
    ui.add_argument(
        "--jobs-dir", type=Path, default=Path("jobs"), help="one folder per job; the only folder the UI serves"
    )
    ui.add_argument("--configs-dir", type=Path, default=Path("configs"), help="presets offered in the form")
    ui.add_argument(
        "--data-root",
        action="append",
        type=Path,
        default=[],
        metavar="FOLDER",
        help="a folder the Datasets tab may read and edit data in (repeatable; default: the working folder and the "
        "one holding --configs-dir)",
    )
    ui.add_argument("--auth", metavar="USER:PASSWORD", help="require this login (visible in `ps`: prefer --auth-file)")
    ui.add_argument("--auth-file", type=Path, help="require a login from this file (one user:password per line)")
    ui.add_argument("--share", action="store_true", help="also open a public share link (needs --auth)")
    ui.add_argument("--ssl-certfile", type=Path, help="serve HTTPS with this certificate (with --ssl-keyfile)")
    ui.add_argument("--ssl-keyfile", type=Path, help="the certificate's private key")
    ui.add_argument(
        "--public-name",
        action="append",
        default=[],
        metavar="HOST",
        help="a name the UI is reached by besides the address it binds (a reverse proxy's); requests "
        "naming any other host are refused (DNS rebinding)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except DifftuneError as err:
        print(f"{ERROR_PREFIX}{err}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> None:
    written = getattr(args, "target", None) or (args.out if args.command in ("average", "extract") else None)
    if written is not None:  # before any file is read or any layer computed
        refuse_folder_target(written)
    if args.command in ("train", "config"):
        config = load_config(
            args.config, [*args.overrides, *(["log.quiet=true"] if getattr(args, "quiet", False) else [])]
        )
        if args.command == "config":
            print(_with_detected_family(config).to_toml(), end="")
            return
        check_before_start(config)  # train() checks too; here it comes before the seconds of heavy imports
        from difftune.training.train import train  # heavy imports only when needed

        train(config, resume=args.resume)  # its last lines say what it wrote, and for which tool
        return

    if args.command in ("find-batch", "find-lr"):
        _find(args)
        return

    if args.command == "plan":
        _plan(args)
        return

    if args.command == "ui":
        from difftune.webui import app as webui

        auth = webui.read_auth(args.auth, args.auth_file)
        for warning in webui.exposure_warnings(args.host, bool(args.auth), bool(args.ssl_certfile)):
            print(f"difftune: warning: {warning}", file=sys.stderr)
        webui.serve(
            args.jobs_dir,
            args.host,
            args.port,
            auth,
            args.share,
            args.configs_dir,
            args.ssl_certfile,
            args.ssl_keyfile,
            tuple(args.public_name),
            args.data_root,
        )
        return

    from difftune.adapters import export

    if args.command == "eval":
        import json

        from difftune.toy.judge import EvalSettings, concepts_of, evaluate

        concepts, held_out = concepts_of(args.base)
        concept = args.concept or held_out
        if concept not in concepts:
            raise DifftuneError(
                f"difftune eval --concept {concept!r}: not one of {args.base}'s judged concepts: {', '.join(concepts)}"
            )
        settings = EvalSettings(args.samples_per_prompt, args.seed, args.steps, args.guidance_scale)
        seen = [other for other in concepts if other != concept]

        def print_status(line: str) -> None:  # stderr: stdout is the report
            print(f"difftune eval: {line}", file=sys.stderr, flush=True)

        report = evaluate(
            args.base,
            args.adapter,
            seen,
            concept,
            settings,
            args.concept_word,
            None if args.quiet else print_status,
        )
        text = json.dumps(report, indent=2)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        print(text)
    elif args.command == "convert":
        with phase(f"converting {args.source} to the {args.to} layout", print):
            written = export.convert_adapter(args.source, args.target, args.to, args.base)
        print(f"difftune: wrote {written}")
        _note_comfyui_dora(args.target, args.to)
    elif args.command == "average":
        tensors, lora_configs, config_toml = export.average_adapters(args.adapters, args.weights, args.base)
        written = export.write_adapter(args.out, tensors, lora_configs, config_toml, args.to, args.base or "")
        print(f"difftune: wrote {written}")
        _note_comfyui_dora(args.out, args.to)
    elif args.command == "push":
        from difftune.adapters.hub import push

        print(f"difftune: pushed {args.folder}: {push(args.folder, args.repo_id, args.private, args.with_checkpoints)}")
    elif args.command == "resize":
        _resize(args)
    elif args.command == "extract":
        _extract(args)
    elif args.command == "caption":
        _caption(args)
    elif args.command == "request":
        if not (args.output_dir / METRICS_FILE).is_file():
            raise DifftuneError(f"{args.output_dir}: no run there (no {METRICS_FILE}); name a job's train.output_dir")
        ask(args.output_dir, args.what)
        print(f"difftune: asked {args.output_dir} to {args.what} at its next step")
    elif args.command == "merge":
        with phase(
            f"merging {len(args.adapter)} adapter(s) into {args.base} (loading, merging, writing {args.out})", print
        ):
            written = export.merge_into_folder(
                args.base, args.adapter, args.out, args.dtype, args.single_file, args.overwrite
            )
        for path in written:
            print(f"difftune: wrote {path}")
    elif args.command == "sample":
        from difftune.families.common.drawing import generate_images, save_images

        config = _sample_config(args)
        if not config.prompts:
            raise DifftuneError("difftune sample: give at least one --prompt")
        import torch

        from difftune.models.dtypes import DTYPES

        dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        with phase(f"loading {args.base} with {len(args.adapter)} adapter(s)", print):
            options = {"seconds": args.seconds} if args.seconds else None
            components = export.load_with_adapters(args.base, args.adapter, dtype, options)
        samples = generate_images(components, config, components.denoiser.device, "samples")
        paths = save_images(samples, config, args.out)
        drawn = "sounds" if components.family.reads_sound else "clips" if config.frames > 1 else "images"
        print(f"difftune: wrote {len(paths)} {drawn} and grid.png to {args.out}")


def _find(args: argparse.Namespace) -> None:
    """find-batch / find-lr: the result as one JSON line on stdout (progress goes to stderr), optionally saved."""
    import contextlib
    import json

    from difftune.config import write_settings

    if args.write and not args.config:
        raise DifftuneError(f"difftune {args.command} --write needs --config (the file to write into)")
    config = load_config(args.config, args.overrides)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON result alone
        result = _found(args, config)
    if args.write:
        settings = result["settings"]
        write_settings(args.config, settings)
        print(
            f"difftune {args.command}: wrote "
            f"{', '.join(f'{k} = {v:g}' for k, v in settings.items())} into {args.config}",
            file=sys.stderr,
        )
    print(json.dumps(result))


def _found(args: argparse.Namespace, config: Config) -> dict:
    from difftune.training import finders

    if args.command == "find-batch":
        return finders.find_batch(
            config,
            args.max_memory_gb,
            args.max_batch,
            args.steps,
            args.margin,
            args.num_processes,
            report=lambda line: print(line, file=sys.stderr),
        )
    out = args.out or Path(config.train.output_dir) / "find-lr"
    result = finders.find_lr(config, out, args.start_lr, args.end_lr, args.steps)
    print(f"difftune find-lr: wrote {out / finders.LR_PLOT_FILE}", file=sys.stderr)
    return {key: value for key, value in result.items() if key not in ("lrs", "losses", "smoothed_losses")}


def _plan(args: argparse.Namespace) -> None:
    import json

    from difftune.training import plan

    config = load_config(args.config, args.overrides)
    device_memory = plan.parse_size(args.device_memory) if args.device_memory else None
    host_memory = plan.parse_size(args.host_memory) if args.host_memory else None
    device = args.device or ("cuda" if device_memory else None)  # a GPU's memory asked about: plan for one

    def print_status(line: str) -> None:  # stderr: stdout is the plan (or its JSON line)
        print(line, file=sys.stderr)

    with plan.plans_remembered():  # the settings tried start from the job's own plan
        with phase("planning the run's memory (its model built without weights, one step counted)", print_status):
            predicted = plan.on_a_device_of(plan.plan_memory(config, device), device_memory)
        with phase("trying the settings that fit", print_status if device_memory or host_memory else None):
            fitting = (
                plan.fitting_overrides(
                    config, device_memory, host_memory, device, report=lambda line: print_status(f"  {line}")
                )
                if device_memory or host_memory
                else None
            )
    if args.json:
        result = {
            "configs": predicted.configs,
            "device_type": predicted.device_type,
            "device_peak": predicted.device_peak,
            "host_peak": predicted.host_peak,
            "device": predicted.device,
            "host": predicted.host,
            "host_phases": predicted.host_phases,
        }
        if device_memory or host_memory:
            result["fits_with"] = fitting[0] if fitting else None
        print(json.dumps(result))
        return
    print(predicted.report())
    if not (device_memory or host_memory):
        return
    print(verdict(predicted, fitting, device_memory, host_memory))
    if fitting and fitting[0]:
        print(fitting[1].report())


def verdict(predicted, fitting, device_memory: int | None, host_memory: int | None) -> str:
    """The plan's answer in words: whether the job as configured fits the budgets, and with what it would."""
    budgets = ((device_memory, "GPU"), (host_memory, "RAM"))
    within = " and ".join(f"{size / 2**30:.1f} GiB {where}" for size, where in budgets if size)
    if fitting is not None and not fitting[0]:
        return f"difftune plan: as configured: fits in {within}"
    if fitting is None:
        return (
            f"difftune plan: as configured: does not fit in {within}, and no setting tried does (gradient "
            "checkpointing, fp8 weights and text encoders, offloaded blocks, smaller batches)"
        )
    return f"difftune plan: as configured: does not fit in {within}; fits with {' '.join(fitting[0])}"


def _resize(args) -> None:
    from difftune.adapters.resize import resize_file

    with phase(f"resizing {args.source}", print):
        written, rows, layout = resize_file(args.source, args.target, args.rank, args.keep_fro, args.to, args.base)
    _report_lora_tool(rows, args.report, written, layout)


def _caption(args) -> None:
    from difftune.data.captioning import caption_folder, load_captioner

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise DifftuneError("caption: --batch-size and --max-new-tokens must be at least 1")
    with phase(f"loading {args.model}", print):
        captioner = load_captioner(args.model, args.prompt, args.device, args.max_new_tokens)
    report = caption_folder(
        args.folder, captioner, args.caption_extension, args.metadata, args.overwrite, args.batch_size
    )
    for problem in report.unreadable:
        print(f"difftune: skipping {problem}")
    where = args.folder / "metadata.jsonl" if args.metadata else f"{args.caption_extension} files in {args.folder}"
    print(
        f"difftune: captioned {report.written} image(s) into {where}; {report.kept} already captioned, left as they "
        f"were{'' if args.overwrite else ' (--overwrite captions them again)'}"
    )


def _extract(args) -> None:
    from difftune.adapters.extract import extract_file

    with phase(f"loading {args.base} and {args.tuned}, extracting the difference as a LoRA", print):
        written, rows = extract_file(
            args.base,
            args.tuned,
            args.out,
            args.rank,
            args.keep_fro,
            args.to,
            args.min_difference,
            args.device,
            args.all_layers,
        )
    _report_lora_tool(rows, args.report, written, args.to)


def _report_lora_tool(rows, report: Path | None, written: Path, layout: str) -> None:
    """What resize and extract say: the summary, the per-layer report if asked for, the file written."""
    import json
    from dataclasses import asdict

    from difftune.adapters.resize import summary

    print(f"difftune: {summary(rows)}")
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
        print(f"difftune: wrote {report}")
    print(f"difftune: wrote {written} ({layout} layout)")


def _note_comfyui_dora(written: Path, layout: str) -> None:
    from safetensors import safe_open

    from difftune.adapters.kohya import COMFYUI_DORA_NOTE

    if layout != "kohya":
        return
    with safe_open(written, framework="pt") as handle:
        if any(key.endswith(".dora_scale") for key in handle.keys()):
            print(f"difftune: {COMFYUI_DORA_NOTE}")


if __name__ == "__main__":
    sys.exit(main())
