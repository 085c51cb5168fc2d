"""What `difftune plan` says fits, as the table each family's page shows (docs/families/<family>.md):
`python scripts/plan_table.py --config configs/X.toml` prints its markdown rows for 12, 16 and 24 GB GPUs with 32 and
64 GB of RAM, planned offline from the configs difftune keeps (the fitting settings' peaks, else the job's own). The
host peaks are given with the first plan's own process memory (`python and libraries`): later plans in one process
start from a little more, which a fresh `difftune plan` would not."""

import argparse

from difftune.config import load_config, parse_size
from difftune.training import plan

GPUS = (12, 16, 24)
RAMS = (32, 64)


def row(config, gpu: int, ram: int, baseline: int) -> str:
    fitting = plan.fitting_overrides(config, parse_size(f"{gpu}GB"), parse_size(f"{ram}GB"), "cuda")
    if fitting is None:
        verdict, planned = "no setting tried fits", plan.plan_memory(config, "cuda")
    else:
        overrides, planned = fitting
        verdict = f"fits with `{' '.join(overrides)}`" if overrides else "fits as shipped"
    return (
        f"| {gpu} GB | {ram} GB | {verdict} | {planned.device_peak / 2**30:.1f} GiB | "
        f"{(planned.host_peak - planned.host['python and libraries'] + baseline) / 2**30:.1f} GiB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    config = load_config(args.config, [])
    with plan.plans_remembered():  # each budget's ladder plans the settings the one before planned
        baseline = plan.plan_memory(config, "cuda").host["python and libraries"]
        print("| GPU | RAM | the plan says | device peak | host RAM peak |")
        print("| --- | --- | --- | ---: | ---: |")
        for gpu in GPUS:
            for ram in RAMS:
                print(row(config, gpu, ram, baseline), flush=True)


if __name__ == "__main__":
    main()
