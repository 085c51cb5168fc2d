"""The Gradio front-end (`difftune ui`): configure, launch and watch jobs, sample, export.

Everything it does is a library call: the form is `form.form_fields()` (the config schema), jobs are `queue.submit`
(one job a device at a time) / `jobs.stop_job` / `resume_job` / `ask_job`, sampling is `export.load_with_adapters`
plus `sample.generate_images`, export is `export.merge_into_folder` / `convert_adapter`, as in the CLI.

Safe by default: it binds 127.0.0.1; another host, or a share link, needs a login; files are served
from the jobs folder only; uploads are capped; exports are written under `<jobs>/exports/` only.
"""

from __future__ import annotations

import hmac
import socket
import tempfile
import time
from functools import partial
from pathlib import Path

import gradio as gr
import pandas as pd
from starlette.middleware import Middleware

from difftune.config import TRAINING_ONLY_SAMPLE_FIELDS, Config, ModelConfig, SampleConfig
from difftune.errors import DifftuneError
from difftune.models.dtypes import DTYPES
from difftune.owned_files import write_file
from difftune.training.finders import LR_PLOT_FILE
from difftune.training.validation import describe_best, read_best
from difftune.webui import draws, jobs, machine, queue
from difftune.webui.datasets_tab import dataset_sources, datasets_tab
from difftune.webui.form import (
    DEFAULT_PRESET,
    FormField,
    Preset,
    config_from_widgets,
    file_widget_values,
    form_fields,
    form_toml,
    parse_adapter_lines,
    presets,
)
from difftune.webui.messages import error_markdown as _error
from difftune.webui.request_filters import LOOPBACK_NAMES, AllowedHosts, OwnFilesOnly, UploadLimit

LOCAL_HOSTS = LOOPBACK_NAMES
EXPORTS_DIR = "exports"
CONFIGS_DIR = "configs"  # configs saved from the form, under the jobs folder so they can be downloaded
MAX_UPLOAD = "1mb"  # config files are a few KB
MAX_UPLOAD_BYTES = 2**20 + 2**16  # a whole upload request: the 1 MB, and its multipart envelope
PLOTTED = ("loss", "grad_norm", "lr")


def check_exposure(host: str, auth: list[tuple[str, str]] | None, share: bool) -> None:
    """Refuse to serve beyond this machine without a login."""
    if (host not in LOCAL_HOSTS or share) and not auth:
        where = "a public share link" if share else f"--host {host}"
        raise DifftuneError(
            f"{where} exposes the UI (which runs jobs and reads files) beyond this machine: give --auth user:password "
            f"or --auth-file FILE, or keep the default --host 127.0.0.1"
        )


def read_auth(auth: str | None, auth_file: Path | None) -> list[tuple[str, str]] | None:
    """`user:password`, or a file with one such line per user."""
    lines = [auth] if auth else []
    if auth_file:
        try:
            lines += [line for line in auth_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        except OSError as err:
            raise DifftuneError(f"--auth-file {auth_file}: cannot read it ({err.strerror})") from None
    pairs = []
    for line in lines:
        user, sep, password = line.strip().partition(":")
        if not (sep and user and password):
            raise DifftuneError("--auth / --auth-file: each login must look like user:password")
        pairs.append((user, password))
    return pairs or None


class LoginGuard:
    """Gradio's login check with a limit on guessing: after `max_failures` wrong passwords for a user (or
    `max_failures` x 4 for all users together) within `window_seconds`, every login of that user (of everyone) is
    refused, the right password too, until the window has passed. Passwords are compared in constant time."""

    def __init__(self, logins: list[tuple[str, str]], max_failures: int = 5, window_seconds: float = 300.0):
        self.logins = dict(logins)
        self.max_failures, self.window_seconds = max_failures, window_seconds
        self.failures: dict[str | None, list[float]] = {}  # user (None: everyone) -> times of recent failures

    def __call__(self, user: str, password: str) -> bool:
        now = time.monotonic()
        for who in (user, None):
            self.failures[who] = [t for t in self.failures.get(who, []) if now - t < self.window_seconds]
        if len(self.failures[user]) >= self.max_failures or len(self.failures[None]) >= 4 * self.max_failures:
            return False
        expected = self.logins.get(user)
        if expected is not None and hmac.compare_digest(expected.encode(), password.encode()):
            return True
        self.failures[user].append(now)
        self.failures[None].append(now)
        return False


def exposure_warnings(host: str, auth_on_command_line: bool, tls: bool) -> list[str]:
    """What the chosen way of serving leaves open, to say at start-up."""
    warnings = []
    if auth_on_command_line:
        warnings.append(
            "--auth puts the password on the command line, where `ps` shows it to every user of this "
            "machine; use --auth-file (one user:password per line, readable by you alone)"
        )
    if host not in LOCAL_HOSTS and not tls:
        warnings.append(
            f"--host {host} serves plain HTTP: logins and everything else cross the network unencrypted; "
            "give --ssl-certfile and --ssl-keyfile, or serve it behind a TLS reverse proxy (docs/guides/web-ui.md)"
        )
    return warnings


def serve(
    jobs_dir: Path,
    host: str,
    port: int,
    auth: list[tuple[str, str]] | None,
    share: bool,
    configs_dir: Path,
    ssl_certfile: Path | None = None,
    ssl_keyfile: Path | None = None,
    public_names: tuple[str, ...] = (),
    data_roots: list[Path] | None = None,
) -> None:
    check_exposure(host, auth, share)
    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise DifftuneError("--ssl-certfile and --ssl-keyfile go together: give both, or neither")
    jobs_dir = jobs_dir.resolve()
    jobs_dir.mkdir(parents=True, exist_ok=True)
    app = build_app(jobs_dir, configs_dir, data_roots).queue()
    if not share:  # Gradio's own lines would say "set share=True in launch()": ours names the flag
        print(
            f"difftune ui: http{'s' if ssl_certfile else ''}://{host}:{port} (jobs in {jobs_dir}); a public link: "
            "difftune ui --share --auth-file FILE",
            flush=True,
        )
    app.launch(
        quiet=not share,  # sharing: Gradio prints the public link
        server_name=host,
        server_port=port,
        auth=LoginGuard(auth) if auth else None,
        share=share,
        allowed_paths=[str(jobs_dir)],
        max_file_size=MAX_UPLOAD,
        footer_links=[],
        ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
        ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
        app_kwargs={"middleware": guards(host, share, public_names)},
    )


def guards(host: str, share: bool, public_names: tuple[str, ...] = ()) -> list:
    """The server's own checks before Gradio's (request_filters.py): the hosts it serves, the upload cap per request."""
    served = (
        (host, socket.gethostname(), socket.getfqdn(), *public_names)
        if host in ("0.0.0.0", "::")
        else (host, *public_names)
    )
    return [
        Middleware(AllowedHosts, names=served, share=share),
        Middleware(OwnFilesOnly),
        Middleware(UploadLimit, max_bytes=MAX_UPLOAD_BYTES),
    ]


def default_data_roots(configs_dir: Path) -> list[Path]:
    """Where the Datasets tab reads and edits data unless told (`--data-root`): the folder the UI starts in, and the
    one holding its presets folder (whose configs name their data relative to it)."""
    return list(dict.fromkeys([Path.cwd().resolve(), Path(configs_dir).resolve().parent]))


def build_app(jobs_dir: Path, configs_dir: Path, data_roots: list[Path] | None = None) -> gr.Blocks:
    jobs_dir = Path(jobs_dir).resolve()
    roots = [Path(root).resolve() for root in data_roots] if data_roots else default_data_roots(configs_dir)
    fields = form_fields()
    offered = presets(configs_dir)
    with gr.Blocks(title="difftune") as app:
        gr.Markdown("# difftune")
        with gr.Tabs() as tabs:
            with gr.Tab("Configure", id="configure"):
                widgets, job_name, device, launch = _configure_tab(fields, offered, jobs_dir)
            with gr.Tab("Datasets", id="datasets"):
                dataset_picker = datasets_tab(jobs_dir, configs_dir, roots)
            with gr.Tab("Train", id="train"):
                job_picker = _train_tab(jobs_dir)
            with gr.Tab("Sample", id="sample"):
                _sample_tab(jobs_dir)
            with gr.Tab("Export", id="export"):
                _export_tab(jobs_dir)

        launch_message = gr.Markdown(elem_id="launch-message")

        def launch_job(name, device, *values):
            try:
                job = queue.submit(config_from_widgets(fields, list(values)), jobs_dir, name, device)
            except DifftuneError as err:
                return _error(err), gr.update(), gr.update()
            if job.status() == "queued":  # its device runs another job: it starts when that one ends
                waiting = [entry for entry in queue.queued(jobs_dir) if entry[2] == job.name]
                place = f", number {waiting[0][1]} in its queue" if waiting else ""
                return f"Queued **{job.name}** on {device}{place}", gr.update(), gr.Tabs(selected="train")
            return (
                f"Launched **{job.name}**",
                gr.update(choices=_job_names(jobs_dir), value=job.name),
                gr.Tabs(selected="train"),
            )

        launch.click(launch_job, [job_name, device, *widgets], [launch_message, job_picker, tabs])
        app.load(lambda: _job_choices(jobs_dir), None, job_picker)
        app.load(lambda: gr.update(choices=dataset_sources(jobs_dir, configs_dir)), None, dataset_picker)
    return app


def _configure_tab(fields: list[FormField], offered: list[Preset], jobs_dir: Path):
    """The form, filled from the default job's preset where the configs folder has it (the first preset offered)."""
    paths = {preset.name: preset.path for preset in offered}
    first = DEFAULT_PRESET if DEFAULT_PRESET in paths else None
    with gr.Row():
        preset = gr.Dropdown(
            [(preset.label, preset.name) for preset in offered],
            label="Preset (configs/)",
            value=first,
            elem_id="preset",
            scale=3,
        )
        upload = gr.UploadButton("Load a config file (.toml)", file_types=[".toml"], type="filepath", elem_id="upload")
        job_name = gr.Textbox(first or "job", label="Job name", elem_id="job-name")
    with gr.Row():
        validate = gr.Button("Validate", elem_id="validate")
        save = gr.Button("Save config", elem_id="save-config")
        # Each device runs one job at a time: a job launched while its device is busy waits in that device's queue.
        device = gr.Dropdown(queue.devices(), value=queue.devices()[0], label="Device", elem_id="device")
        launch = gr.Button("Launch training", variant="primary", elem_id="launch")
    message = gr.Markdown(elem_id="config-message")
    saved = gr.File(label="Saved config", visible=False, elem_id="saved-config")
    defaults = Config()
    values = dict(
        zip(
            (field.key for field in fields),
            file_widget_values(paths[first], fields)
            if first
            else [field.to_widget(getattr(getattr(defaults, field.section), field.name)) for field in fields],
            strict=True,
        )
    )
    widgets = []
    for section in Config.model_fields:
        section_fields = [field for field in fields if field.section == section]
        with gr.Accordion(f"[{section}]", open=section in ("model", "data", "adapter", "train")):
            for row in range(0, len(section_fields), 3):
                with gr.Row(equal_height=False):
                    for field in section_fields[row : row + 3]:
                        widgets.append(_widget(field, values[field.key]))

    def load_file(path):
        if not path:
            return [gr.update()] * len(widgets) + [""]
        try:
            values = file_widget_values(Path(path), fields)
        except DifftuneError as err:
            return [gr.update()] * len(widgets) + [_error(err)]
        return values + [f"Loaded {Path(path).name}"]

    def check(*values):
        try:
            config_from_widgets(fields, list(values))
        except DifftuneError as err:
            return _error(err)
        return "The config is valid."

    def save_toml(name, *values):
        try:
            text = form_toml(fields, list(values))
            path = _inside(jobs_dir / CONFIGS_DIR, f"{name}.toml")
        except DifftuneError as err:
            return gr.update(visible=False), _error(err)
        write_file(path, text, "the jobs folder's configs/")  # a link planted in its place is replaced
        return gr.update(value=str(path), visible=True), f"Saved `{path}`"

    _finders(fields, widgets, job_name, jobs_dir)
    # A preset names the job after itself; a loaded file leaves the preset list (the form is no longer a preset).
    preset.change(
        lambda name: [*load_file(paths[name]), name] if name else [gr.update()] * (len(widgets) + 2),
        preset,
        [*widgets, message, job_name],
    )
    upload.upload(
        lambda path: [*load_file(path), None, Path(path).stem if path else gr.update()],
        upload,
        [*widgets, message, preset, job_name],
    )
    validate.click(check, widgets, message)
    save.click(save_toml, [job_name, *widgets], [saved, message])
    return widgets, job_name, device, launch


def _finders(fields: list[FormField], widgets: list, job_name: gr.Textbox, jobs_dir: Path) -> None:
    """`difftune find-batch` and `find-lr` on the form's config; their answer can be applied to the form."""
    with gr.Accordion("Finders: the batch size that fits, a learning rate", open=False, elem_id="finders"):
        with gr.Row():
            max_memory = gr.Number(0, label="Memory budget, GB", info="0: free memory less 10%", elem_id="find-memory")
            max_batch = gr.Number(64, precision=0, label="Largest batch size tried", elem_id="find-max-batch")
            find_batch = gr.Button("Find batch size", elem_id="find-batch")
        with gr.Row():
            lr_steps = gr.Number(100, precision=0, label="Range-test steps", elem_id="find-lr-steps")
            start_lr = gr.Number(1e-7, label="Start learning rate", elem_id="find-start-lr")
            end_lr = gr.Number(1.0, label="End learning rate", elem_id="find-end-lr")
            find_lr = gr.Button("Find learning rate", elem_id="find-lr")
        found = gr.Markdown(elem_id="finder-message")
        plot = gr.Image(label="Learning-rate range test", visible=False, elem_id="lr-plot")
        apply = gr.Button("Apply to the form", visible=False, elem_id="apply-found")
        settings = gr.State({})

    def run(finder, name, options, values):
        try:
            config = config_from_widgets(fields, list(values))
            result, folder = jobs.run_finder(config, jobs_dir, name, finder, [str(option) for option in options])
        except DifftuneError as err:
            return _error(err), gr.update(visible=False), gr.update(visible=False), {}
        if finder == "find-batch":
            text = (
                f"Largest batch size that fits: **{result['largest_batch_size']}** "
                f"(peak {result['trials'][-1].get('peak_bytes', 0) / 2**30:.2f} GiB in the last trial); train with "
                f"batch size {result['batch_size']} x {result['gradient_accumulation_steps']} accumulation steps."
            )
            return text, gr.update(visible=False), gr.update(visible=True), result["settings"]
        text = (
            f"Suggested learning rate: **{result['suggested_lr']:.3g}** "
            "(a tenth of the rate at the lowest smoothed loss)."
        )
        if result["note"]:
            text += f" Note: {result['note']}."
        image = gr.update(value=str(folder / LR_PLOT_FILE), visible=True)
        return text, image, gr.update(visible=True), result["settings"]

    outputs = [found, plot, apply, settings]
    find_batch.click(
        lambda name, memory, largest, *values: run(
            "find-batch", name, (["--max-memory-gb", memory] if memory else []) + ["--max-batch", int(largest)], values
        ),
        [job_name, max_memory, max_batch, *widgets],
        outputs,
    )
    find_lr.click(
        lambda name, steps, start, end, *values: run(
            "find-lr", name, ["--steps", int(steps), "--start-lr", start, "--end-lr", end], values
        ),
        [job_name, lr_steps, start_lr, end_lr, *widgets],
        outputs,
    )
    apply.click(
        lambda chosen: [gr.update(value=chosen[field.key]) if field.key in chosen else gr.update() for field in fields],
        settings,
        widgets,
    )


def _widget(field: FormField, value, id_prefix: str = "field"):
    """`field`'s input, showing `value` (as `FormField.to_widget` gives it)."""
    label, info, elem_id = field.key, field.info.description, f"{id_prefix}-{field.section}-{field.name}"
    if field.kind == "bool":
        return gr.Checkbox(value, label=label, info=info, elem_id=elem_id)
    if field.kind == "choice":
        return gr.Dropdown(field.choices, value=value, label=label, info=info, elem_id=elem_id)
    if field.kind in ("int", "float"):
        return gr.Number(value, label=label, info=info, precision=0 if field.kind == "int" else None, elem_id=elem_id)
    lines = 3 if field.kind in ("list", "table") else 1
    hint = {
        "list": " (one per line)",
        "pair": " (comma-separated)",
        "table": " (TOML: one `key = value` per line)",
        "optional": " (empty: the default described)",
    }.get(field.kind, "")
    return gr.Textbox(value, label=label, info=info + hint, lines=lines, elem_id=elem_id)


def _train_tab(jobs_dir: Path):
    with gr.Row():
        job_picker = gr.Dropdown([], label="Job", elem_id="job-picker", scale=3)
        refresh = gr.Button("Refresh list", scale=1)
        # Shown when they apply to the job picked: Stop to a running one, Resume to one stopped or failed.
        stop = gr.Button("Stop (checkpoint)", variant="stop", scale=1, elem_id="stop", visible=False)
        resume = gr.Button("Resume", scale=1, elem_id="resume", visible=False)
        # Asked of a running job at its next step, which goes on: its sample prompts drawn, a checkpoint and snapshot.
        sample_now = gr.Button("Sample now", scale=1, elem_id="sample-now", visible=False)
        save_now = gr.Button("Save now", scale=1, elem_id="save-now", visible=False)
    status = gr.Markdown(elem_id="job-status")
    machine_state = gr.Markdown(elem_id="machine")  # the machine now, and the picked job's planned and measured peaks
    with gr.Row():
        plots = [gr.LinePlot(x="step", y=name, title=name, height=220, elem_id=f"plot-{name}") for name in PLOTTED]
        # Validation loss, with the kept best point as a series of its own.
        plots.append(
            gr.ScatterPlot(
                x="step", y="val_loss", color="series", title="val_loss", height=220, elem_id="plot-val_loss"
            )
        )
        # A reward run's mean score per step (`reward.method`): what it trains for.
        plots.append(gr.LinePlot(x="step", y="reward", title="reward", height=220, elem_id="plot-reward"))
    # Sample grids at their own size or smaller, whole: a tiny model's 128 px grid is not blown up, a wide one not cut.
    previews = gr.Gallery(
        label="Samples (newest first)", columns=4, height="auto", object_fit="scale-down", elem_id="previews"
    )
    with gr.Row():  # every draw the run made, by step, each sample captioned with its prompt (draws.py)
        draw_picker = gr.Dropdown([], label="Samples drawn at", elem_id="draw-picker", scale=1)
        pinned_draw = gr.State(None)  # a draw the person picked; else the newest is shown as it comes
        drawn = gr.Gallery(
            label="Samples of that draw", columns=6, height="auto", object_fit="scale-down", elem_id="drawn", scale=4
        )
    log = gr.Textbox(label="Log", lines=14, max_lines=14, autoscroll=True, elem_id="job-log")
    with gr.Row():  # the jobs waiting for their device (queue.py): moved, or cancelled before they start
        with gr.Column(scale=3):  # a table in Markdown: a Dataframe's rows showed a reorder late or never
            waiting = gr.Markdown(_queue_table([]), elem_id="queue")
        with gr.Column(scale=1):
            queued_job = gr.Dropdown([], label="Queued job", elem_id="queued-job")
            with gr.Row():
                earlier = gr.Button("Up", elem_id="queue-up")
                later = gr.Button("Down", elem_id="queue-down")
                cancel = gr.Button("Cancel", variant="stop", elem_id="queue-cancel")

    def show(name, pinned=None):
        hidden = [gr.update(visible=False)] * 4
        none_drawn = gr.update(choices=[], value=None)
        if not name:
            return ["No job selected."] + [None] * len(plots) + [[], "", *hidden, none_drawn]
        job = jobs.Job(jobs_dir / name)
        try:
            config = job.config()
        except DifftuneError as err:  # a folder deleted or edited by hand since the list was made
            return [_error(err)] + [None] * len(plots) + [[], "", *hidden, none_drawn]
        max_steps = config.train.max_steps
        rows = jobs.read_progress(job)
        step = rows[-1]["step"] if rows else 0
        status = job.status()
        summary = f"**{status}** · step {step} / {max_steps} ({100 * step // max_steps}%)"
        if rows:
            summary += f" · loss {rows[-1]['loss']:.4f} · {1 / rows[-1]['seconds']:.2f} steps/s"
        best = read_best(job.dir)
        summary += "".join(f" · {line}" for line in describe_best(best))
        if status == "failed":
            summary += f"\n\n{jobs.failure_reason(job)}"
        frame = pd.DataFrame(rows, columns=["step", *PLOTTED]) if rows else None
        frames = [frame[["step", column]] if frame is not None else None for column in PLOTTED]
        # A run without validation has no validation loss to plot: no empty frame for it.
        frames.append(gr.update(value=jobs.validation_frame(rows, best), visible=bool(config.validation.path)))
        rewards = pd.DataFrame(rows, columns=["step", "reward"]) if rows and config.reward.enabled else None
        frames.append(gr.update(value=rewards, visible=config.reward.enabled))
        grids = [(str(path), str(path.parent.relative_to(job.dir))) for path in jobs.preview_grids(job)]
        running = status == "running"
        buttons = [gr.update(visible=running), gr.update(visible=status in ("stopped", "failed"))]
        buttons += [gr.update(visible=running)] * 2  # sample now, save now
        return [summary, *frames, grids, jobs.log_tail(job), *buttons, _draw_choices(job, pinned)]

    def act(action, name):
        try:
            if not name:
                raise DifftuneError("pick a job first")
            action(jobs.Job(jobs_dir / name))
        except DifftuneError as err:
            gr.Warning(str(err))

    outputs = [status, *plots, previews, log, stop, resume, sample_now, save_now, draw_picker]
    # The draws' gallery follows the job picked, also where its draw of the same label stays picked.
    job_picker.change(show, job_picker, outputs).then(lambda: None, None, pinned_draw).then(
        lambda name, label: _drawn(jobs_dir, name, label), [job_picker, draw_picker], drawn
    )
    gr.Timer(2.0).tick(show, [job_picker, pinned_draw], outputs)
    draw_picker.input(lambda label: label, draw_picker, pinned_draw)
    draw_picker.change(lambda name, label: _drawn(jobs_dir, name, label), [job_picker, draw_picker], drawn)
    refresh.click(lambda name: gr.update(choices=_job_names(jobs_dir), value=name), job_picker, job_picker)
    stop.click(lambda name: act(jobs.stop_job, name), job_picker, None)
    resume.click(lambda name: act(jobs.resume_job, name), job_picker, None)
    sample_now.click(lambda name: act(partial(jobs.ask_job, what="sample"), name), job_picker, None)
    save_now.click(lambda name: act(partial(jobs.ask_job, what="save"), name), job_picker, None)

    def show_queue(picked, queued_name):
        """The queues, after starting the first job of each free device (the queue moves while the UI is open); the
        machine, and the picked job's memory."""
        started = queue.advance(jobs_dir)
        entries = queue.queued(jobs_dir)
        names = [name for _, _, name in entries]
        # A job the queue started joins the list; a pick is left alone (this tick's `picked` may be older than a job
        # just launched and picked, and setting it would undo that pick). An empty picker shows the newest job, as an
        # opened page does: on a loaded machine the picker emptied after a launch had picked its job (an answer to the
        # page's opening, computed before the launch, arriving after it), and the newest job is the one launched.
        if not picked and (job_names := _job_names(jobs_dir)):
            picker = gr.update(choices=job_names, value=job_names[0])
        elif started:
            picker = gr.update(choices=_job_names(jobs_dir))
        else:
            picker = gr.update()
        lines = [machine.machine_line(machine.machine_state(jobs_dir))]
        lines += [
            f"The queue file could not be read: kept as {kept.name}; the queue was rebuilt from the job folders."
            for kept in queue.set_aside
        ]
        if picked and (jobs_dir / picked / jobs.JOB_STATE).is_file():
            lines += machine.job_memory_lines(machine.job_memory(jobs.Job(jobs_dir / picked)))
        # The pick is cleared only once its job has left the queue: a tick sent before the person picked carries the
        # old value, and setting it would undo their pick just before they press Up.
        if queued_name and queued_name not in names:
            queued_picker = gr.update(choices=names, value=None)
        else:
            queued_picker = gr.update(choices=names)
        return _queue_table(entries), queued_picker, picker, "  \n".join(lines)

    def reorder(action, queued_name):
        try:
            if not queued_name:
                raise DifftuneError("pick a queued job first")
            action(jobs_dir, queued_name)
        except DifftuneError as err:
            gr.Warning(str(err))

    gr.Timer(2.0).tick(show_queue, [job_picker, queued_job], [waiting, queued_job, job_picker, machine_state])
    earlier.click(lambda name: reorder(partial(queue.move, offset=1), name), queued_job, None)
    later.click(lambda name: reorder(partial(queue.move, offset=-1), name), queued_job, None)
    cancel.click(lambda name: reorder(queue.cancel, name), queued_job, None)
    return job_picker


def _queue_table(entries: list[tuple[str, int, str]]) -> str:
    """The queues as a Markdown table: device, place, job folder."""
    rows = [f"| {device} | {place} | {name} |" for device, place, name in entries] or ["| | | nothing queued |"]
    return "**Queue**\n\n| device | place | job |\n| --- | ---: | --- |\n" + "\n".join(rows)


def _draw_choices(job: jobs.Job, pinned: str | None):
    """The job's draws as choices: the one picked by hand kept, else the newest (each new draw shown as it comes)."""
    labels = [draw.label for draw in draws.draws(job)]
    return gr.update(choices=labels, value=pinned if pinned in labels else (labels[-1] if labels else None))


def _drawn(jobs_dir: Path, name: str | None, label: str | None) -> list:
    """The samples of the draw `label` of job `name`, each captioned with its prompt; clips as video."""
    if not name or not label:
        return []
    job = jobs.Job(jobs_dir / name)
    found = next((draw for draw in draws.draws(job) if draw.label == label), None)
    return [(str(draws.playable(path)), draws.drawn_prompt(path)) for path in found.files(job)] if found else []


def _job_names(jobs_dir: Path) -> list[str]:
    return [job.name for job in jobs.find_jobs(jobs_dir)]


def _job_choices(jobs_dir: Path):
    """The job list as the page opens: every job, the newest selected."""
    names = _job_names(jobs_dir)
    return gr.update(choices=names, value=names[0] if names else None)


def _job_adapters(jobs_dir: Path) -> list[str]:
    """Adapter files the jobs wrote (raw, EMA, averaged), newest job first."""
    return [str(path) for job in jobs.find_jobs(jobs_dir) for path in sorted(job.dir.glob("*.safetensors"))]


def _adapter_inputs(jobs_dir: Path, id_prefix: str, base: gr.Textbox):
    """The adapters box and a picker of the jobs' adapters. An adapter from a job brings the base that job trained
    on into `base` (whatever folder the UI was started in)."""
    picker = gr.Dropdown(_job_adapters(jobs_dir), label="Adapter from a job", value=None)
    adapters = gr.Textbox(
        label="Adapters",
        lines=2,
        info="one per line: FILE or FILE:SCALE (any tool's layout)",
        elem_id=f"{id_prefix}-adapters",
    )
    picker.focus(lambda: gr.update(choices=_job_adapters(jobs_dir)), None, picker)
    picker.change(
        lambda path, text: text if not path else "\n".join(filter(None, [text.strip(), path + ":1.0"])),
        [picker, adapters],
        adapters,
    )
    adapters.change(lambda text, current: _trained_base(text) or current, [adapters, base], base)
    return adapters


def _trained_base(adapter_text: str) -> str | None:
    """The `model.base` of the job that wrote the first adapter listed, when it comes from a job folder."""
    try:
        first = parse_adapter_lines(adapter_text)[0][0]
        return jobs.Job(first.parent).config().model.base if (first.parent / jobs.JOB_CONFIG).is_file() else None
    except (IndexError, DifftuneError):
        return None


def _shown(sample, config: SampleConfig):
    """What the gallery shows of a sample: its image, its clip written as `save_clip` writes it (a file), or its sound
    as a gallery plays it (`draws.playable`)."""
    if sample.sound is not None:
        return str(draws.playable(sample.sound))
    if not sample.clip:
        return sample.image
    from difftune.families.common.drawing import sample_tags, save_clip

    folder = Path(tempfile.mkdtemp(prefix="difftune-sample-"))
    return str(save_clip(sample.clip, folder / f"{sample.seed:03d}", config.fps, sample_tags(sample, config)))


def _sample_tab(jobs_dir: Path):
    from difftune.families.common.drawing import generate_images

    fields = [field for field in form_fields(["sample"]) if field.name not in TRAINING_ONLY_SAMPLE_FIELDS]
    base = gr.Textbox(
        ModelConfig().base, label="Base model", info=ModelConfig.model_fields["base"].description, elem_id="sample-base"
    )
    adapters = _adapter_inputs(jobs_dir, "sample", base)
    with gr.Row():  # resolution left empty: the model's native size
        widgets = [_widget(field, field.to_widget(getattr(SampleConfig(), field.name)), "sample") for field in fields]
    compare_ema = gr.Checkbox(False, label="Also sample each adapter's EMA weights (its `_ema` file) side by side")
    generate = gr.Button("Generate", variant="primary", elem_id="generate")
    message = gr.Markdown(elem_id="sample-message")
    with gr.Row():
        raw_gallery = gr.Gallery(
            label="Adapters as trained", columns=4, height=300, object_fit="contain", elem_id="gallery"
        )
        ema_gallery = gr.Gallery(
            label="EMA adapters", columns=4, height=300, object_fit="contain", elem_id="gallery-ema"
        )

    def run(base_name, adapter_text, ema, *values):
        from difftune.adapters.export import load_with_adapters, variant_of

        try:
            config = config_from_widgets(fields, list(values), "sample", section="sample")
            if not config.prompts:
                raise DifftuneError("sample.prompts: give at least one prompt")
            adapters = parse_adapter_lines(adapter_text)
            runs = [adapters]
            if ema:
                runs.append([(variant_of(path, "_ema"), scale) for path, scale in adapters])
            galleries = []
            for run_adapters in runs:
                components = load_with_adapters(base_name, run_adapters)
                samples = generate_images(components, config, components.denoiser.device)
                galleries.append(
                    [(_shown(sample, config), f"{sample.prompt} · seed {sample.seed}") for sample in samples]
                )
        except Exception as err:  # noqa: BLE001 - whatever went wrong is said on the page, not as a bare "Error"
            return _error(err), [], []
        return f"{len(galleries[0])} images per gallery.", galleries[0], galleries[1] if ema else []

    generate.click(run, [base, adapters, compare_ema, *widgets], [message, raw_gallery, ema_gallery])


def _export_tab(jobs_dir: Path):
    from difftune.adapters import export
    from difftune.adapters.extract import extract_file
    from difftune.adapters.resize import resize_file, summary

    exports = jobs_dir / EXPORTS_DIR
    gr.Markdown(f"Everything is written under `{exports}`.")
    with gr.Group():
        gr.Markdown("### Merge adapters into the base")
        base = gr.Textbox(ModelConfig().base, label="Base model", elem_id="merge-base")
        adapters = _adapter_inputs(jobs_dir, "merge", base)
        with gr.Row():
            out_name = gr.Textbox("merged", label="Output folder name", elem_id="merge-out")
            dtype = gr.Dropdown(list(DTYPES), value="fp16", label="Saved dtype")
            single_file = gr.Checkbox(False, label="Also write model.safetensors (single-file layout)")
            overwrite = gr.Checkbox(False, label="Replace an existing folder")
        merge = gr.Button("Merge", variant="primary", elem_id="merge")
        merge_message = gr.Markdown(elem_id="merge-message")
    with gr.Group():
        gr.Markdown("### Convert an adapter's layout")
        source = gr.Textbox(label="Adapter file", elem_id="convert-source")
        with gr.Row():
            layout = gr.Dropdown(list(export.FORMATS), value="kohya", label="Write layout")
            target_name = gr.Textbox("adapter.safetensors", label="Output file name", elem_id="convert-out")
        convert = gr.Button("Convert", elem_id="convert")
        convert_message = gr.Markdown(elem_id="convert-message")
    with gr.Group():  # the LoRA tools of the CLI (`difftune resize` / `extract`), with their refusals and messages
        gr.Markdown("### Resize a LoRA (SVD of each layer's change)")
        resize_source = gr.Textbox(label="LoRA file", elem_id="resize-source")
        with gr.Row():
            resize_rank = gr.Number(None, label="Rank (most kept)", precision=0, elem_id="resize-rank")
            resize_keep = gr.Number(None, label="Keep this share of each change (0-1)", elem_id="resize-keep")
            resize_name = gr.Textbox("resized.safetensors", label="Output file name", elem_id="resize-out")
        resize = gr.Button("Resize", elem_id="resize")
        resize_message = gr.Markdown(elem_id="resize-message")
    with gr.Group():
        gr.Markdown("### Extract a LoRA from a full fine-tune")
        with gr.Row():
            extract_base = gr.Textbox(ModelConfig().base, label="Base model", elem_id="extract-base")
            extract_tuned = gr.Textbox(label="Fine-tuned model (a run's model/ folder)", elem_id="extract-tuned")
        with gr.Row():
            extract_rank = gr.Number(16, label="Rank (most kept)", precision=0, elem_id="extract-rank")
            extract_keep = gr.Number(None, label="Keep this share of each change (0-1)", elem_id="extract-keep")
            extract_layout = gr.Dropdown(list(export.FORMATS), value="diffusers", label="Write layout")
            extract_name = gr.Textbox("extracted.safetensors", label="Output file name", elem_id="extract-out")
        extract = gr.Button("Extract", elem_id="extract")
        extract_message = gr.Markdown(elem_id="extract-message")

    def do_merge(base_name, adapter_text, name, dtype_name, single, replace):
        try:
            written = export.merge_into_folder(
                base_name, parse_adapter_lines(adapter_text), _inside(exports, name), dtype_name, single, replace
            )
        except Exception as err:  # noqa: BLE001 - as in Sample
            return _error(err)
        return "Wrote " + ", ".join(f"`{path}`" for path in written)

    def do_convert(source_path, layout_name, name):
        try:
            written = export.convert_adapter(Path(source_path.strip()), _inside(exports, name), layout_name)
        except Exception as err:  # noqa: BLE001 - as in Sample
            return _error(err)
        return f"Wrote `{written}`"

    def do_resize(source_path, rank, keep, name):
        try:
            written, rows, _ = resize_file(Path(source_path.strip()), _inside(exports, name), _rank(rank), keep or None)
        except Exception as err:  # noqa: BLE001 - as in Sample
            return _error(err)
        return f"Wrote `{written}`: {summary(rows)}"

    def do_extract(base_name, tuned_name, rank, keep, layout_name, name):
        try:
            written, rows = extract_file(
                base_name.strip(), tuned_name.strip(), _inside(exports, name), _rank(rank), keep or None, layout_name
            )
        except Exception as err:  # noqa: BLE001 - as in Sample
            return _error(err)
        return f"Wrote `{written}`: {summary(rows)}"

    merge.click(do_merge, [base, adapters, out_name, dtype, single_file, overwrite], merge_message)
    convert.click(do_convert, [source, layout, target_name], convert_message)
    resize.click(do_resize, [resize_source, resize_rank, resize_keep, resize_name], resize_message)
    extract.click(
        do_extract,
        [extract_base, extract_tuned, extract_rank, extract_keep, extract_layout, extract_name],
        extract_message,
    )


def _rank(value) -> int | None:
    """A rank field's value: empty or 0 is none (the other limit decides)."""
    return int(value) if value else None


def _inside(folder: Path, name: str) -> Path:
    """`folder/name`, refusing names that lead out of `folder` (`..`, absolute paths) or hold control characters (a
    newline in a file name breaks every listing and log that names it)."""
    path = (folder / name.strip()).resolve()
    plain = name.strip() and name.isprintable()
    if not plain or not path.is_relative_to(folder.resolve()) or path == folder.resolve():
        raise DifftuneError(f"output name {name!r}: give a plain name; outputs are written under {folder}")
    return path
