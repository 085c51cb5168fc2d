"""The web UI in a real browser (Debian's chromium through playwright), and what it serves.

The browser tests drive the whole path a person takes: a dataset opened, a caption edited -> preset -> form -> launch
-> watch progress and the loss plot -> sample with the trained adapter -> merge and resize; and a long job asked to
sample and save while two more wait in its device's queue, through a restart of the UI. Screenshots of each tab go to
a temporary folder, or to $DIFFTUNE_SCREENSHOTS (docs/ keeps them).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from safetensors.torch import load_file

from difftune.config import load_config
from difftune.errors import DifftuneError
from difftune.webui.app import _inside, check_exposure, read_auth

from conftest import free_port

# How long a browser test waits for the page to show an event's answer: on CI's loaded machine the sample tab's
# base came from the adapter's job after expect's 5 s default (2026-12-04); a right page answers in well under 1 s.
EXPECT_MS = 30_000

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SECRET = "difftune-test-secret-4f1c"


def start_ui(root: Path, jobs_dir: Path) -> tuple[subprocess.Popen, int]:
    """`python ui/app.py` on a free port, started in `root` (outside the repository: presets from its configs/, whose
    paths resolve against their own folder), jobs in `jobs_dir`; returns once it answers."""
    port = free_port()
    log = open(root / "server.log", "ab")
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "ui" / "app.py"),
            "--port",
            str(port),
            "--jobs-dir",
            str(jobs_dir),
            "--configs-dir",
            str(REPO / "configs"),
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    log.close()
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the UI did not start: " + (root / "server.log").read_text()) from None
            time.sleep(0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The UI, started in a temporary folder that holds its jobs and, beside them, a secret it must never serve."""
    root = tmp_path_factory.mktemp("ui")
    jobs_dir = root / "jobs"
    (root / "secret.txt").write_text(SECRET)  # next to the jobs folder: must never be served
    process, port = start_ui(root, jobs_dir)
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "jobs": jobs_dir, "root": root}
    process.terminate()
    process.wait(timeout=30)


def _get(port: int, raw_path: str) -> tuple[int, bytes]:
    """A request with the path sent exactly as written (no client-side normalisation of `..` or escapes)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", raw_path)
    response = connection.getresponse()
    return response.status, response.read()


def test_serves_the_jobs_folder_and_nothing_outside_it(server):
    jobs, root = server["jobs"], server["root"]
    (jobs / "public.txt").write_text("served from the jobs folder")
    status, body = _get(server["port"], f"/gradio_api/file={jobs / 'public.txt'}")
    assert status == 200 and body == b"served from the jobs folder"  # the route works, so refusals below mean something

    secret = root / "secret.txt"
    attempts = [
        f"/gradio_api/file={secret}",  # absolute
        f"/gradio_api/file={jobs}/../secret.txt",  # ../ out of the jobs folder
        f"/gradio_api/file={jobs}/%2e%2e/secret.txt",  # encoded dots
        f"/gradio_api/file={quote(str(jobs / '..' / 'secret.txt'), safe='')}",  # everything encoded
        f"/gradio_api/file={jobs}/%252e%252e/secret.txt",  # double-encoded
        f"/gradio_api/file={jobs}/..%2fsecret.txt",  # encoded slash
        "/gradio_api/file=/etc/passwd",
        "/gradio_api/file=../../../../etc/passwd",
        "/gradio_api/file=README.md",  # relative to the server's working folder (the repo)
        "/file=/etc/passwd",
        "/gradio_api/file=models/tiny-sd/model_index.json",
    ]
    for path in attempts:
        status, body = _get(server["port"], path)
        assert SECRET.encode() not in body, path
        assert b"root:" not in body and b"difftune" not in body.lower(), path
        assert status in (400, 403, 404), (path, status)


def test_a_file_linked_into_the_jobs_folder_is_not_served(server):
    """A train.log hard-linked (or symbolically linked) to a file outside the jobs folder: the page no longer showed
    it, but the file route served it (200); now 403, its content unsent."""
    jobs, root = server["jobs"], server["root"]
    job = jobs / "20260101-000000-linked"
    job.mkdir()
    os.link(root / "secret.txt", job / "train.log")
    (job / "grid.png").symlink_to(root / "secret.txt")
    (job / "own.txt").write_text("the job's own")
    assert _get(server["port"], f"/gradio_api/file={job / 'own.txt'}") == (200, b"the job's own")
    for name in ("train.log", "grid.png"):
        status, body = _get(server["port"], f"/gradio_api/file={job / name}")
        assert status == 403 and SECRET.encode() not in body, (name, status)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it")
def test_configure_train_sample_merge_in_a_browser(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=EXPECT_MS)

    shots = Path(os.environ.get("DIFFTUNE_SCREENSHOTS", tmp_path))
    jobs = server["jobs"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server["url"])
        job_name = page.locator("#job-name input, #job-name textarea").first

        # No job yet: no Stop or Resume to press.
        page.get_by_role("tab", name="Train").click()
        expect(page.locator("#job-status")).to_contain_text("No job selected")
        expect(page.locator("#stop")).to_be_hidden()
        expect(page.locator("#resume")).to_be_hidden()

        # Datasets: a folder (a copy of the default job's data, under the UI's working folder, a data root) opens as
        # a gallery with captions; a caption edited in place is on disk, the old one in the history; the check says
        # what a run leaves out and its buckets. A folder outside the data roots is refused.
        data = server["root"] / "data"
        shutil.copytree(REPO / "examples" / "purple", data)
        (data / "0003.txt").unlink()
        (data / "0005.png").write_bytes(b"no image")
        page.get_by_role("tab", name="Datasets").click()
        folder = page.locator("#dataset-folder textarea, #dataset-folder input").first
        folder.fill(str(tmp_path))
        page.locator("#dataset-open").click()
        expect(page.locator("#dataset-summary")).to_contain_text("outside the folders this UI reads data from")
        folder.fill(str(data))
        page.locator("#dataset-open").click()
        expect(page.locator("#dataset-summary")).to_contain_text("16 images, 0 clips")
        expect(page.locator("#dataset-summary")).to_contain_text("1 without a caption")
        page.locator("#dataset-gallery img").nth(1).click()
        caption = page.locator("#dataset-caption textarea")
        expect(caption).to_have_value((data / "0001.txt").read_text().strip())
        old_caption = caption.input_value()
        caption.fill("a purple square, edited in the browser")
        page.locator("#dataset-save").click()
        expect(page.locator("#dataset-saved")).to_contain_text("Saved to")
        assert (data / "0001.txt").read_text() == "a purple square, edited in the browser\n"
        expect(page.locator("#dataset-history")).to_contain_text(old_caption)
        page.locator("#dataset-check").click()
        expect(page.locator("#dataset-verdicts")).to_contain_text("0005.png", timeout=30_000)
        expect(page.locator("#dataset-verdicts")).to_contain_text("cannot be decoded")
        expect(page.locator("#dataset-verdicts")).to_contain_text("0003.png: no caption")
        expect(page.locator("#dataset-buckets")).to_contain_text("15")  # 16 images less the broken one, at 512x512
        page.screenshot(path=str(shots / "ui_datasets.png"), full_page=True)
        folder.fill("")
        page.locator("#dataset-source input").click()
        page.get_by_role("option", name=re.compile(r"^preset tiny_lora: data.path")).click()
        page.locator("#dataset-open").click()
        expect(page.locator("#dataset-summary")).to_contain_text(str(REPO / "examples" / "purple"))
        page.get_by_role("tab", name="Configure").click()

        # Configure: the form opens on the default job's preset, named after it; a config file or another preset
        # fills it (the job name follows); a bad value is reported by the schema, then fixed.
        expect(page.locator("#preset input")).to_have_value(re.compile(r"^tiny_lora: The default job"))
        expect(job_name).to_have_value("tiny_lora")
        expect(page.locator("#field-train-max_steps input")).to_have_value("400")
        page.screenshot(path=str(shots / "ui_configure.png"))
        uploaded = tmp_path / "mine.toml"
        uploaded.write_text("[train]\nmax_steps = 7\n")
        page.locator("#upload input[type=file], input[type=file]").first.set_input_files(str(uploaded))
        expect(page.locator("#config-message")).to_contain_text("Loaded mine.toml")
        expect(page.locator("#field-train-max_steps input")).to_have_value("7")
        expect(job_name).to_have_value("mine")
        page.locator("#preset input").click()
        page.get_by_role("option", name="tiny_dora").click()
        expect(page.locator("#config-message")).to_contain_text("Loaded tiny_dora.toml")
        expect(job_name).to_have_value("tiny_dora")
        page.locator("#preset input").click()
        page.get_by_role("option", name="tiny_lora:").click()
        expect(page.locator("#config-message")).to_contain_text("Loaded tiny_lora.toml")
        data_path = page.locator("#field-data-path textarea, #field-data-path input").first
        expect(data_path).to_have_value(str(REPO / "examples" / "purple"))  # the preset's path, from its own folder

        # The finders run on the form's config; their answers go into the form.
        page.get_by_text("Finders: the batch size that fits, a learning rate").click()
        page.locator("#find-lr-steps input").fill("20")
        page.locator("#find-end-lr input").fill("100")
        page.locator("#find-lr").click()
        expect(page.locator("#finder-message")).to_contain_text("Suggested learning rate", timeout=120_000)
        expect(page.locator("#lr-plot img")).to_be_visible()
        lr_range = next((jobs / "finders").glob("*-tiny_lora-find-lr/lr_range.json"))
        found_lr = json.loads(lr_range.read_text())["learning_rate"]
        page.locator("#apply-found").click()
        page.get_by_text("[optim]", exact=True).click()  # a closed section: its fields render on opening
        expect(page.locator("#field-optim-learning_rate input")).not_to_have_value(
            "0.001", timeout=10_000
        )  # the preset's
        page.locator("#find-max-batch input").fill("2")
        page.locator("#find-batch").click()
        expect(page.locator("#finder-message")).to_contain_text("Largest batch size that fits: 2", timeout=120_000)
        page.screenshot(path=str(shots / "ui_finders.png"), full_page=True)
        page.locator("#apply-found").click()
        expect(page.locator("#field-train-batch_size input")).to_have_value("2", timeout=10_000)
        max_steps = page.locator("#field-train-max_steps input")
        max_steps.fill("0")
        max_steps.press("Tab")
        page.locator("#validate").click()
        expect(page.locator("#config-message")).to_contain_text("train.max_steps")
        max_steps.fill("40")
        max_steps.press("Tab")
        page.get_by_text("[sample]", exact=True).click()  # a closed section: its fields render on opening
        every = page.locator("#field-sample-every_steps input")
        expect(every).to_have_value("0")  # rendered with the preset's value, so the edit below is not overwritten
        page.wait_for_timeout(500)
        every.fill("20")
        every.press("Tab")
        expect(every).to_have_value("20")
        page.get_by_text("[ema]", exact=True).click()
        ema = page.locator("#field-ema-enabled input")
        expect(ema).not_to_be_checked()
        page.wait_for_timeout(500)
        ema.check()
        page.locator("#job-name input, #job-name textarea").first.fill("browser")
        page.locator("#validate").click()
        expect(page.locator("#config-message")).to_contain_text("The config is valid.")
        page.locator("#save-config").click()
        expect(page.locator("#config-message")).to_contain_text("Saved")
        saved = load_config(jobs / "configs" / "browser.toml")
        assert (saved.train.max_steps, saved.sample.every_steps, saved.ema.enabled) == (40, 20, True)
        assert (saved.train.batch_size, saved.optim.learning_rate) == (2, pytest.approx(found_lr))
        # A 20-step sweep's suggestion is a test of the wiring, not a rate to train the 40 steps below with.
        learning_rate = page.locator("#field-optim-learning_rate input")
        learning_rate.fill("0.001")
        learning_rate.press("Tab")
        page.locator("#launch").click()

        # Train: the job appears, progresses, plots its loss, shows previews and finishes.
        expect(page.locator("#launch-message")).to_contain_text("Launched", timeout=30_000)
        status = page.locator("#job-status")
        expect(status).to_contain_text("step", timeout=120_000)
        expect(status).to_contain_text("finished", timeout=600_000)
        expect(status).to_contain_text("step 40 / 40")
        expect(page.locator("#stop")).to_be_hidden()  # a finished job: nothing to stop, nothing to resume
        expect(page.locator("#resume")).to_be_hidden()
        expect(page.locator("#plot-loss canvas, #plot-loss svg").first).to_be_visible(timeout=30_000)
        expect(page.locator("#previews img").first).to_be_visible(timeout=30_000)
        expect(page.locator("#plot-val_loss")).to_be_hidden()  # no validation in this job: no empty plot
        # Each sample grid drawn whole (not cropped) and never past its own size (not blown up): `scale-down`.
        fits = page.locator("#previews img").evaluate_all("images => images.map(i => getComputedStyle(i).objectFit)")
        assert fits and set(fits) == {"scale-down"}, fits
        page.screenshot(path=str(shots / "ui_train.png"))
        adapter = next(jobs.glob("*-browser/pytorch_lora_weights.safetensors"))

        # Sample: base + the trained adapter -> a gallery, and its EMA weights beside it.
        page.get_by_role("tab", name="Sample").click()
        page.locator("#sample-adapters textarea").fill(f"{adapter}:1.0")
        # The UI runs outside the repository: the adapter's job brings its base, absolute.
        expect(page.locator("#sample-base textarea, #sample-base input").first).to_have_value(
            str(REPO / "models" / "tiny-sd")
        )
        page.locator("#sample-sample-prompts textarea").fill("a purple circle\na red square")
        steps = page.locator("#sample-sample-steps input")
        steps.fill("10")
        steps.press("Tab")
        page.get_by_label("Also sample each adapter's EMA weights").check()
        page.locator("#generate").click()
        expect(page.locator("#sample-message")).to_contain_text("2 images per gallery", timeout=300_000)
        expect(page.locator("#gallery img").first).to_be_visible()
        expect(page.locator("#gallery-ema img").first).to_be_visible()
        page.screenshot(path=str(shots / "ui_sample.png"), full_page=True)

        # Export: merge into the base; the merged UNet differs from the base where the adapter acts.
        page.get_by_role("tab", name="Export").click()
        page.locator("#merge-adapters textarea").fill(str(adapter))
        page.locator("#merge-out input, #merge-out textarea").first.fill("purple-merged")
        page.locator("#merge").click()
        expect(page.locator("#merge-message")).to_contain_text("Wrote", timeout=300_000)
        # The LoRA tools: a resize with no limit is refused as the CLI refuses it, then done at rank 2.
        page.locator("#resize-source input, #resize-source textarea").first.fill(str(adapter))
        page.locator("#resize").click()
        expect(page.locator("#resize-message")).to_contain_text("--rank", timeout=30_000)
        page.locator("#resize-rank input").fill("2")
        page.locator("#resize").click()
        expect(page.locator("#resize-message")).to_contain_text("Wrote", timeout=60_000)
        page.screenshot(path=str(shots / "ui_export.png"), full_page=True)

        # Reopened, the page shows the newest job at once; a job that fails says why in its status line.
        page.goto(server["url"])
        page.get_by_role("tab", name="Train").click()
        expect(page.locator("#job-status")).to_contain_text("finished · step 40 / 40", timeout=30_000)
        page.get_by_role("tab", name="Configure").click()
        page.locator("#preset input").click()
        page.get_by_role("option", name="tiny_dora").click()
        expect(page.locator("#config-message")).to_contain_text("Loaded tiny_dora.toml")
        page.locator("#field-data-path textarea, #field-data-path input").first.fill(str(tmp_path / "no-such-folder"))
        page.locator("#job-name input, #job-name textarea").first.fill("broken")
        page.locator("#launch").click()
        expect(page.locator("#job-status")).to_contain_text("failed", timeout=300_000)
        expect(page.locator("#job-status")).to_contain_text(f"data.path {tmp_path / 'no-such-folder'}: does not exist")
        expect(page.locator("#resume")).to_be_visible()  # a failed job may be resumed (and says why it cannot)
        expect(page.locator("#stop")).to_be_hidden()
        browser.close()

    resized = load_file(jobs / "exports" / "resized.safetensors")
    assert {tensor.shape[0] for key, tensor in resized.items() if key.endswith("lora_A.weight")} == {2}
    merged_dir = jobs / "exports" / "purple-merged"
    assert (merged_dir / "model_index.json").exists()
    base_unet = load_file(REPO / "models/tiny-sd/unet/diffusion_pytorch_model.safetensors")
    merged = load_file(merged_dir / "unet/diffusion_pytorch_model.safetensors")
    changed = [
        key for key in merged if "to_q" in key and not (merged[key].float() - base_unet[key].float()).abs().max() < 1e-3
    ]
    assert changed, "merging the adapter changed no attention weight"


def test_the_server_says_where_it_serves_with_its_own_flags(server):
    """Gradio's start-up lines told a CLI user to "set `share=True` in `launch()`"; the UI says its address and flag."""
    log = (server["root"] / "server.log").read_text()
    assert f"difftune ui: http://127.0.0.1:{server['port']} (jobs in {server['jobs']})" in log, log
    assert "share=True" not in log and "launch()" not in log


def test_presets_come_default_first_described_and_marked_when_they_need_a_gpu(tmp_path):
    from difftune.webui.form import presets

    offered = presets(REPO / "configs")
    assert offered[0].name == "tiny_lora" and offered[0].summary.startswith(
        "The default job: teach the bundled tiny base"
    )
    here = [preset.base_is_here for preset in offered]
    assert here == sorted(here, reverse=True) and any(here) and not all(here)  # those that run here, then the rest
    qwen = next(preset for preset in offered if preset.name == "qwen_image_1024_lora")
    assert qwen.label.startswith("qwen_image_1024_lora [GPU, downloads its base]: A LoRA on Qwen-Image (the 20B MMDiT")
    assert all(len(preset.summary) <= 111 and "\n" not in preset.summary for preset in offered)
    (tmp_path / "broken.toml").write_text("[model\n")
    (tmp_path / "plain.toml").write_text("# Mine. More words.\n[train]\nmax_steps = 3\n")
    assert [(preset.name, preset.summary) for preset in presets(tmp_path)] == [("plain", "Mine")]


def test_uploads_are_capped(server):
    boundary = "difftuneboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="big.toml"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + b"#" * (2 * 1024 * 1024)
        + f"\r\n--{boundary}--\r\n".encode()
    )
    connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    connection.request(
        "POST", "/gradio_api/upload", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    response = connection.getresponse()
    assert response.status == 413, response.read()[:200]


def _post(port: int, path: str, body: bytes, headers: dict) -> tuple[int, bytes, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, body, headers)
    response = connection.getresponse()
    return response.status, response.read(), dict(response.getheaders())


def test_requests_for_another_host_are_refused(server):
    """DNS rebinding: a page of evil.example resolved to 127.0.0.1 sends `Host: evil.example` and its own `Origin`. A
    POST so was answered 200 with that origin echoed in Access-Control-Allow-Origin; now 403 before Gradio sees it (its
    CORS layer, outside ours, may still echo the origin on the refusal: nothing ran), as is a foreign Origin under our
    own Host. The UI's own requests (its host, by name or address) are answered."""
    port = server["port"]
    call = json.dumps({"data": [], "fn_index": 0}).encode()
    for headers in (
        {"Host": "evil.example", "Origin": "http://evil.example"},
        {"Host": f"127.0.0.1:{port}", "Origin": "http://evil.example"},
        {"Host": f"evil.example:{port}"},
        # A page served on another local port: its origin was echoed in Access-Control-Allow-Origin.
        {"Host": f"127.0.0.1:{port}", "Origin": "http://localhost:9999"},
        {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port + 1}"},
    ):
        status, body, _ = _post(port, "/gradio_api/queue/join", call, {"Content-Type": "application/json", **headers})
        assert status == 403 and b"this host is not served here" in body, (headers, status)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/", headers={"Host": host, "Origin": f"http://{host}"})
        assert connection.getresponse().status == 200, host


def test_uploads_are_capped_per_request_not_only_per_file(server):
    """Gradio's cap is per file: three 0.9 MB files in one request passed a 1 MB cap."""
    boundary = "difftuneboundary"
    part = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="part.toml"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + b"#" * 900_000
        + b"\r\n"
    )
    body = part * 3 + f"--{boundary}--\r\n".encode()
    status, answer, _ = _post(
        server["port"], "/gradio_api/upload", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    assert status == 413 and b"capped" in answer


def test_guards_name_the_hosts_served():
    from difftune.webui.request_filters import AllowedHosts, host_name

    guard = AllowedHosts(None, names=("studio.example.com",), share=False)
    assert host_name("http://[::1]:7860") == "::1" and host_name("LocalHost:7860") == "localhost"
    assert all(
        guard.allows(host_name(value))
        for value in ("127.0.0.1:7860", "localhost", "studio.example.com", "http://10.1.2.3:7860", "[::1]:7860")
    )
    assert not any(guard.allows(host_name(value)) for value in ("evil.example", "", "null", "abc.gradio.live"))
    assert AllowedHosts(None, share=True).allows("abc.gradio.live")


def test_exposure_beyond_this_machine_needs_a_login():
    check_exposure("127.0.0.1", None, share=False)
    check_exposure("0.0.0.0", [("ann", "pw")], share=False)
    with pytest.raises(DifftuneError, match="--host 0.0.0.0 exposes the UI.*--auth"):
        check_exposure("0.0.0.0", None, share=False)
    with pytest.raises(DifftuneError, match="share link"):
        check_exposure("127.0.0.1", None, share=True)


def test_auth_file_and_bad_logins(tmp_path):
    logins = tmp_path / "logins"
    logins.write_text("ann:one\n\nbob:two:three\n")
    assert read_auth("cy:pw", logins) == [("cy", "pw"), ("ann", "one"), ("bob", "two:three")]
    with pytest.raises(DifftuneError, match="user:password"):
        read_auth("no-colon", None)
    with pytest.raises(DifftuneError, match="--auth-file .*missing"):
        read_auth(None, tmp_path / "missing")


def test_cli_refuses_an_open_host_without_login():
    result = subprocess.run(
        [sys.executable, "-m", "difftune.cli", "ui", "--host", "0.0.0.0"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and "--auth" in result.stderr


def test_outputs_stay_inside_their_folder(tmp_path):
    assert _inside(tmp_path, "merged") == (tmp_path / "merged").resolve()
    for name in ("../escape", "/etc/x", "a/../../b", "", ".", "merged\nline", "tab\there"):
        with pytest.raises(DifftuneError, match="plain name"):
            _inside(tmp_path, name)


def test_logins_are_limited_after_wrong_passwords(monkeypatch):
    """50 wrong passwords, then the right one: refused while the window lasts (it was accepted), then accepted."""
    from difftune.webui import app as webui

    now = [1000.0]
    monkeypatch.setattr(webui.time, "monotonic", lambda: now[0])
    guard = webui.LoginGuard([("ann", "right"), ("bob", "other")], max_failures=5, window_seconds=300)
    assert guard("ann", "right")
    for attempt in range(50):
        assert not guard("ann", f"guess-{attempt}")
    assert not guard("ann", "right")
    now[0] += 301
    assert guard("ann", "right")
    for user in [f"user-{i}" for i in range(20)]:  # guesses spread over many names lock everyone for the window
        assert not guard(user, "x")
    assert not guard("bob", "other")
    now[0] += 301
    assert guard("bob", "other")


def test_the_served_ui_checks_logins_through_the_guard_and_warns_what_it_leaves_open(tmp_path, monkeypatch, capsys):
    import gradio as gr

    from difftune.cli import main
    from difftune.webui import app as webui

    launched = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kwargs: launched.update(kwargs))
    logins = tmp_path / "logins"
    logins.write_text("ann:right\n")
    assert (
        main(
            [
                "ui",
                "--host",
                "0.0.0.0",
                "--auth",
                "cy:pw",
                "--jobs-dir",
                str(tmp_path / "jobs"),
                "--configs-dir",
                str(REPO / "configs"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "--auth puts the password on the command line, where `ps` shows it" in err
    assert "--host 0.0.0.0 serves plain HTTP" in err and "--ssl-certfile" in err
    assert isinstance(launched["auth"], webui.LoginGuard) and launched["ssl_certfile"] is None
    assert (
        main(
            [
                "ui",
                "--host",
                "0.0.0.0",
                "--auth-file",
                str(logins),
                "--ssl-certfile",
                str(tmp_path / "c.pem"),
                "--ssl-keyfile",
                str(tmp_path / "k.pem"),
                "--jobs-dir",
                str(tmp_path / "jobs"),
            ]
        )
        == 0
    )
    assert capsys.readouterr().err == ""
    assert launched["ssl_certfile"] == str(tmp_path / "c.pem") and launched["auth"]("ann", "right")
    assert main(["ui", "--ssl-certfile", str(tmp_path / "c.pem"), "--jobs-dir", str(tmp_path / "jobs")]) == 2
    assert "--ssl-certfile and --ssl-keyfile go together" in capsys.readouterr().err


def test_a_file_that_is_no_adapter_is_named_as_such(tmp_path, capsys):
    """Sample and merge with a file that is not safetensors: one line (the CLI printed a traceback, the UI a bare
    "Error"); the UI's page shows unexpected failures with their kind."""
    from difftune.cli import main
    from difftune.webui import app as webui

    notes = tmp_path / "notes.safetensors"
    notes.write_text("a text file")
    assert (
        main(
            [
                "sample",
                "--base",
                str(REPO / "models" / "tiny-sd"),
                "--adapter",
                str(notes),
                "--prompt",
                "a red circle",
                "--out",
                str(tmp_path / "samples"),
            ]
        )
        == 2
    )
    assert f"adapter {notes}: not a readable safetensors file" in capsys.readouterr().err
    assert webui._error(ValueError("boom")) == "**Error**\n\n```\nValueError: boom\n```"


def test_a_merge_into_a_used_folder_says_how_to_replace_it_in_either_tool(tmp_path):
    from difftune.adapters import export

    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "keep.txt").write_text("earlier work")
    with pytest.raises(
        DifftuneError,
        match=r"merged: already exists and is not empty; choose another folder, or replace it "
        r"\(the CLI's --overwrite, the UI's \"Replace an existing folder\"\)",
    ):
        export.merge_into_folder(str(REPO / "models" / "tiny-sd"), [], tmp_path / "merged")
    assert (tmp_path / "merged" / "keep.txt").read_text() == "earlier work"


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it")
def test_queue_sample_now_save_now_and_a_restart_in_a_browser(tmp_path):
    """A long job asked to sample and to save while it runs; two more queued behind it and reordered; the UI restarted
    with them queued: it finds the running job, starts nothing while it runs, then each queued job once, in order."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=EXPECT_MS)

    from difftune.training.checkpoint import complete_checkpoints
    from difftune.webui import jobs as ui_jobs
    from difftune.webui import queue as ui_queue

    shots = Path(os.environ.get("DIFFTUNE_SCREENSHOTS", tmp_path))
    jobs = tmp_path / "jobs"
    process, port = start_ui(tmp_path, jobs)

    def folder(name: str) -> Path:
        return next(jobs.glob(f"*-{name}"))

    def wait_for(condition, what: str, seconds: float = 600):
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
            time.sleep(0.5)

    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}")

            def launch(name: str, steps: int, said: re.Pattern):
                page.get_by_role("tab", name="Configure").click()
                max_steps = page.locator("#field-train-max_steps input")
                max_steps.fill(str(steps))
                max_steps.press("Tab")
                page.locator("#job-name input, #job-name textarea").first.fill(name)
                page.locator("#launch").click()
                expect(page.locator("#launch-message")).to_contain_text(said, timeout=30_000)

            # A job long enough to be asked things while it runs (it is stopped below), started beside this page, as
            # another UI on this jobs folder starts one: the page's empty picker shows it within a refresh (as it shows
            # a job launched here whose pick a late answer to the page's opening emptied, which CI's machine saw).
            page.get_by_role("tab", name="Train").click()
            status = page.locator("#job-status")
            expect(status).to_contain_text("No job selected")
            long_config = load_config(
                REPO / "configs" / "tiny_lora.toml", ["train.max_steps=100000", "sample.before=false"]
            )
            long_dir = ui_queue.submit(long_config, jobs, "long", ui_queue.CPU).dir
            expect(page.locator("#job-picker input")).to_have_value(long_dir.name, timeout=60_000)
            expect(status).to_contain_text(re.compile(r"running · step [1-9]"), timeout=600_000)
            page.locator("#sample-now").click()
            wait_for(lambda: any(long_dir.glob("samples/step-*/grid.png")), "the asked samples")
            drawn_at = next(long_dir.glob("samples/step-*")).name
            expect(page.locator("#draw-picker input")).to_have_value(f"step {int(drawn_at[5:])}", timeout=120_000)
            expect(page.locator("#drawn img").first).to_be_visible(timeout=120_000)
            prompt = load_config(REPO / "configs" / "tiny_lora.toml").sample.prompts[0]
            expect(page.locator("#drawn")).to_contain_text(prompt)
            page.locator("#save-now").click()
            wait_for(lambda: complete_checkpoints(long_dir), "the asked checkpoint")
            wait_for(lambda: any(long_dir.glob("snapshots/step-*")), "the asked snapshot")
            assert ui_jobs.Job(long_dir).status() == "running"  # asked, it went on

            # Two more on the same device wait their turn; the last one is moved ahead of the other.
            launch("second", 5, re.compile(r"Queued \S+-second on cpu, number 1 in its queue"))
            launch("third", 5, re.compile(r"Queued \S+-third on cpu, number 2 in its queue"))
            page.get_by_role("tab", name="Train").click()
            expect(page.locator("#queue")).to_contain_text("third", timeout=30_000)
            page.locator("#queued-job input").click()
            page.get_by_role("option", name=re.compile("third$")).click()
            page.wait_for_timeout(5000)  # two of the queue's refreshes: the pick stays
            expect(page.locator("#queued-job input")).to_have_value(folder("third").name)
            page.locator("#queue-up").click()
            reordered = [folder("third").name, folder("second").name]
            wait_for(lambda: [entry[2] for entry in ui_queue.queued(jobs)] == reordered, "the reorder")
            expect(page.locator("#queue")).to_contain_text(re.compile(r"third.*second", re.S), timeout=30_000)
            page.screenshot(path=str(shots / "ui_queue.png"), full_page=True)
            started = ui_jobs.Job(long_dir).state()

            # The UI restarted with both queued: the running job is found again, nothing starts while it runs.
            process.terminate()
            process.wait(timeout=30)
            process, port = start_ui(tmp_path, jobs)
            page.goto(f"http://127.0.0.1:{port}")
            page.get_by_role("tab", name="Train").click()
            expect(status).to_contain_text("running", timeout=120_000)
            expect(page.locator("#queue")).to_contain_text("second", timeout=30_000)
            page.wait_for_timeout(3000)  # a few of the queue's refreshes
            assert not (folder("second") / ui_jobs.JOB_STATE).exists()
            assert not (folder("third") / ui_jobs.JOB_STATE).exists()
            assert ui_jobs.Job(long_dir).state() == started

            # Stopped, the long job makes way: the queued ones run in their order, each once.
            page.locator("#stop").click()
            wait_for(lambda: ui_jobs.Job(long_dir).status() == "stopped", "the long job to stop")
            wait_for(lambda: ui_jobs.Job(folder("second")).status() == "finished", "the queued jobs")
            assert ui_jobs.Job(folder("third")).status() == "finished"
            assert ui_queue.queued(jobs) == []
            browser.close()
    finally:
        for job in ui_jobs.find_jobs(jobs):
            if job.process() is not None:
                job.process().kill()
        process.terminate()
        process.wait(timeout=30)

    third, second = ui_jobs.Job(folder("third")).state(), ui_jobs.Job(folder("second")).state()
    assert third["started"] < second["started"]
    for name in ("long", "third", "second"):  # each trainer started once: one "training" phase in each log
        assert (folder(name) / ui_jobs.JOB_LOG).read_text().count("difftune: training ...") == 1, name
