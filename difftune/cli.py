"""The `difftune` command: parse, load the config, call one library function."""

from __future__ import annotations

import argparse
import sys

from difftune.config import Config, load_config
from difftune.errors import DifftuneError


def _keys_help() -> str:
    lines = ["config keys (set in the TOML file, or override as section.key=value):"]
    for section, section_field in Config.model_fields.items():
        for name, field in section_field.annotation.model_fields.items():
            lines.append(f"  {section}.{name}: {field.description}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftune", description="Fine-tune Stable Diffusion with LoRA, DoRA or fully.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in (("train", "train a job"), ("config", "print the resolved config of a job as TOML")):
        command = commands.add_parser(
            name, help=summary, description=summary, epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter
        )
        command.add_argument("--config", help="TOML job file; omitted: all defaults")
        command.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides, e.g. train.max_steps=200")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.command == "config":
            print(config.to_toml(), end="")
        else:
            from difftune.train import train  # heavy imports only when training

            result = train(config)
            if result.trained_path:
                print(f"difftune: wrote {result.trained_path}")
    except DifftuneError as err:
        print(f"difftune: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
