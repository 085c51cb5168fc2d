"""The Datasets tab: open a data folder (typed, or a preset's or job's `[data]`), page through its images and clips
with their captions, edit a caption in place, see an image's mask and controls beside it, check the folder as a run
would (left-out files, the aspect buckets and their counts) and caption the uncaptioned images with `difftune caption`.
What it reads and writes is `datasets.py`'s; this module only lays it out."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from difftune.config import DataConfig, load_config
from difftune.data.sources import is_clip
from difftune.errors import DifftuneError
from difftune.webui import datasets, jobs
from difftune.webui.form import presets
from difftune.webui.messages import error_markdown as _error

DATASETS_DIR = "datasets"  # under the jobs folder: the caption history


def dataset_sources(jobs_dir: Path, configs_dir: Path) -> list[tuple[str, str]]:
    """(label, value) of every dataset a preset or a job names: `preset:<file>:<n>` / `job:<folder>:<n>`, n indexing
    its config's `data.each_dataset()`."""
    found = []
    for preset in presets(configs_dir):
        found += _sources(f"preset {preset.name}", f"preset:{preset.name}", preset.path)
    for job in jobs.find_jobs(jobs_dir):
        found += _sources(f"job {job.name}", f"job:{job.name}", job.dir / jobs.JOB_CONFIG)
    return found


def _sources(label: str, value: str, config_file: Path) -> list[tuple[str, str]]:
    try:
        data = load_config(config_file).data
    except DifftuneError:  # a config this version cannot read offers no dataset
        return []
    keys = data.dataset_keys()
    return [
        (f"{label}: {key} {each.path}", f"{value}:{n}")
        for n, (each, key) in enumerate(zip(data.each_dataset(), keys, strict=True))
    ]


def source_data(value: str, jobs_dir: Path, configs_dir: Path) -> tuple[DataConfig, str]:
    """The `[data]` settings and key a `dataset_sources` value stands for."""
    kind, name, number = value.rsplit(":", 2) if value.count(":") >= 2 else ("", "", "")
    offered = {preset.name: preset.path for preset in presets(configs_dir)}
    if kind == "preset" and name in offered:
        config_file = offered[name]
    elif kind == "job" and name in {job.name for job in jobs.find_jobs(jobs_dir)}:
        config_file = Path(jobs_dir).resolve() / name / jobs.JOB_CONFIG
    else:
        raise DifftuneError(f"dataset {value!r}: no such preset or job; refresh the list")
    data = load_config(config_file).data
    return data.each_dataset()[int(number)], data.dataset_keys()[int(number)]


def datasets_tab(jobs_dir: Path, configs_dir: Path, roots: list[Path]) -> gr.Dropdown:
    """The tab's widgets and what they do; returns the dataset picker (its choices are filled as the page opens)."""
    history = jobs_dir / DATASETS_DIR / datasets.HISTORY_FILE
    listed = ", ".join(f"`{root}`" for root in roots)
    gr.Markdown(f"Datasets are read and edited under {listed} (`difftune ui --data-root` adds a folder).")
    with gr.Row():
        source = gr.Dropdown([], label="Dataset of a preset or job", elem_id="dataset-source", scale=3)
        folder = gr.Textbox(label="or a folder", elem_id="dataset-folder", scale=3)
        stored_file = gr.Dropdown([], label="Stored file shown", visible=False, elem_id="dataset-file", scale=2)
        open_button = gr.Button("Open", variant="primary", elem_id="dataset-open", scale=1)
    summary = gr.Markdown(elem_id="dataset-summary")
    with gr.Row(equal_height=True):
        previous = gr.Button("< Previous page", size="sm", elem_id="dataset-previous")
        page_number = gr.Number(1, precision=0, label="Page", elem_id="dataset-page", minimum=1, min_width=80)
        following = gr.Button("Next page >", size="sm", elem_id="dataset-next")
    with gr.Row():
        # A click selects an image for the editor beside (no enlarged preview over the page).
        gallery = gr.Gallery(
            label="Images and captions",
            columns=6,
            height=480,
            object_fit="contain",
            allow_preview=False,
            elem_id="dataset-gallery",
            scale=3,
        )
        with gr.Column(scale=2):
            shown = gr.Image(label="Selected", interactive=False, height=260, elem_id="dataset-selected")
            beside = gr.Gallery(label="Its mask and controls", columns=3, height=140, elem_id="dataset-beside")
            caption = gr.Textbox(label="Caption", lines=3, elem_id="dataset-caption")
            save = gr.Button("Save caption", elem_id="dataset-save")
            saved = gr.Markdown(elem_id="dataset-saved")
            past = gr.Markdown(elem_id="dataset-history")
    with gr.Accordion("Check as a run would: left-out files and aspect buckets", open=True):
        check = gr.Button("Check every file", elem_id="dataset-check")
        verdicts = gr.Markdown(elem_id="dataset-verdicts")
        buckets = gr.Dataframe(
            headers=["width", "height", "examples"], label="Buckets", interactive=False, elem_id="dataset-buckets"
        )
    with gr.Accordion("Caption the uncaptioned images (`difftune caption`)", open=False):
        with gr.Row():
            model = gr.Textbox(label="Captioning model (folder or hub id)", elem_id="caption-model", scale=3)
            overwrite = gr.Checkbox(False, label="Caption the captioned ones again")
            run_captioner = gr.Button("Caption", elem_id="caption-run")
        captioned = gr.Markdown(elem_id="caption-message")
    # What is open: its settings (as JSON), its items, the selected item's index, the last check's verdicts.
    opened = gr.State(None)
    items = gr.State([])
    selected = gr.State(None)
    said = gr.State({})

    def read(value, typed, stored):
        """The dataset picked or typed, its items, and page 1."""
        try:
            if typed.strip():
                data, key = DataConfig(path=typed.strip()), "folder"
            elif value:
                data, key = source_data(value, jobs_dir, configs_dir)
            else:
                raise DifftuneError("pick a preset's or job's dataset, or type a folder")
            datasets.checked_source(data, roots, key)
            files = datasets.stored_files(data)
            found = datasets.list_items(data, stored if stored in files else None)
        except DifftuneError as err:
            return [_error(err), None, [], gr.update(visible=False), 1, []]
        file_picker = gr.update(choices=files, value=stored if stored in files else files[0]) if files else None
        return [
            _summary(data, found),
            data.model_dump_json(),
            found,
            file_picker or gr.update(visible=False, choices=[], value=None),
            1,
            _gallery(found, 0, {}),
        ]

    def turn(found, number, verdicts_by_file, offset):
        number = min(max(1, int(number or 1) + offset), datasets.page_count(found))
        return number, _gallery(found, number - 1, verdicts_by_file)

    def pick(found, number, event: gr.SelectData):
        index = (int(number or 1) - 1) * datasets.PAGE_SIZE + event.index
        if index >= len(found):  # a click on a page since reopened shorter
            return None, None, [], "", "", ""
        item = found[index]
        extra = [(datasets.thumbnail(item.mask), "mask")] if item.mask else []
        extra += [(datasets.thumbnail(control), f"control {n}") for n, control in enumerate(item.controls, 1)]
        return index, datasets.thumbnail(item.path, 768), extra, item.caption or "", "", _history(history, item)

    def write(found, index, text):
        if index is None:
            return found, "Pick an image first.", ""
        try:
            item = datasets.write_caption(found[index], text, roots, history)
        except DifftuneError as err:
            return found, _error(err), ""
        found = [*found[:index], item, *found[index + 1 :]]
        return found, f"Saved to `{item.caption_file}`", _history(history, item)

    def run_check(settings):
        if not settings:
            return "Open a dataset first.", None, {}
        data = DataConfig.model_validate_json(settings)
        try:
            result = datasets.check_dataset(data)
        except DifftuneError as err:
            return _error(err), None, {}
        lines = [f"**{result.examples} examples** a run trains on (repeats counted)"]
        by_file = result.verdicts()
        lines += [f"- `{path}`: {reason}" for path, reason in by_file.items()] or ["- every file is usable"]
        rows = [[w, h, count] for (w, h), count in sorted(result.buckets.items())]
        return "\n".join(lines), rows, by_file

    def caption_all(settings, model_name, again, progress=gr.Progress(track_tqdm=True)):  # noqa: B008 - Gradio's way
        try:
            if not settings:
                raise DifftuneError("open a dataset first")
            data = DataConfig.model_validate_json(settings)
            report = datasets.caption_uncaptioned(data, model_name, again, roots)
        except DifftuneError as err:
            return _error(err)
        unread = f"; could not read {len(report.unreadable)}" if report.unreadable else ""
        return f"Captioned {report.written} image(s); {report.kept} already captioned, kept{unread}. Open it again."

    outputs = [summary, opened, items, stored_file, page_number, gallery]
    open_button.click(read, [source, folder, stored_file], outputs)
    stored_file.input(read, [source, folder, stored_file], outputs)
    previous.click(lambda f, n, v: turn(f, n, v, -1), [items, page_number, said], [page_number, gallery])
    following.click(lambda f, n, v: turn(f, n, v, 1), [items, page_number, said], [page_number, gallery])
    page_number.submit(lambda f, n, v: turn(f, n, v, 0), [items, page_number, said], [page_number, gallery])
    gallery.select(pick, [items, page_number], [selected, shown, beside, caption, saved, past])
    save.click(write, [items, selected, caption], [items, saved, past]).then(
        lambda f, n, v: _gallery(f, int(n or 1) - 1, v), [items, page_number, said], gallery
    )
    check.click(run_check, opened, [verdicts, buckets, said]).then(
        lambda f, n, v: _gallery(f, int(n or 1) - 1, v), [items, page_number, said], gallery
    )
    run_captioner.click(caption_all, [opened, model, overwrite], captioned)
    source.focus(lambda: gr.update(choices=dataset_sources(jobs_dir, configs_dir)), None, source)
    return source


def _summary(data: DataConfig, found: list[datasets.DatasetItem]) -> str:
    clips = sum(is_clip(item.path) for item in found)
    bare = sum(item.caption is None for item in found)
    sizes = f"buckets around {data.resolution} px" if data.buckets else f"{data.resolution} px squares"
    return (
        f"`{data.path}`: **{len(found) - clips} images, {clips} clips**, {bare} without a caption "
        f'(data.missing_caption = "{data.missing_caption}") · trained as {sizes} · '
        f"{datasets.page_count(found)} page(s)"
    )


def _gallery(found: list[datasets.DatasetItem], number: int, verdicts_by_file: dict[str, str]) -> list:
    """A page of thumbnails, each captioned with its caption (or that it has none) and the last check's verdict."""
    shown = []
    for item in datasets.page(found, number):
        text = item.caption if item.caption is not None else "(no caption)"
        verdict = verdicts_by_file.get(str(item.path))
        shown.append((datasets.thumbnail(item.path), f"{item.name}: {text}" + (f" [{verdict}]" if verdict else "")))
    return shown


def _history(history: Path, item: datasets.DatasetItem) -> str:
    edits = datasets.caption_history(history, item.path)
    if not edits:
        return ""
    lines = [f"- {edit['time']}: was {edit['old']!r}" for edit in edits[:5]]
    return "Earlier captions (newest first):\n" + "\n".join(lines)
