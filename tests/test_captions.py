"""`difftune caption` on a micro Qwen3-VL built from its config: the prompt it is asked, the captions it writes (what
transformers' own call on each image alone generates), never over a caption already there unless asked, and files the
data scan reads."""

import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from difftune.cli import main
from difftune.config import DataConfig
from difftune.data.captioning import CHAT_INSTRUCTION, load_captioner
from difftune.data.dataset import scan_examples
from difftune.errors import DifftuneError
from difftune.toy.tiny import build_qwen3_vl_processor, build_qwen3_vl_text_encoder, shape_images

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def captioner_model(tmp_path_factory):
    """A micro Qwen3-VL and its processor, saved as a hub folder is; its weights drawn wide enough that what it says
    depends on the image."""
    processor = build_qwen3_vl_processor(CHAT_INSTRUCTION)
    model = build_qwen3_vl_text_encoder(processor.tokenizer, with_head=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    folder = tmp_path_factory.mktemp("micro-qwen3-vl")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture
def images(tmp_path):
    """Four shapes at three sizes, one in a `2_more` folder, one already captioned; an edit pair's control beside."""
    folder = tmp_path / "data"
    (folder / "2_more").mkdir(parents=True)
    (folder / "control").mkdir()
    renders = [image for image, _ in shape_images(4, seed=5)]
    for name, image, size in zip(("a", "b", "c"), renders, ((32, 32), (64, 32), (56, 56)), strict=False):
        image.resize(size).save(folder / f"{name}.png")
    renders[3].save(folder / "2_more" / "d.png")
    renders[0].save(folder / "control" / "a.png")
    (folder / "c.txt").write_text("mine, by hand\n", encoding="utf-8")
    return folder


def _alone(model_folder, image_path) -> str:
    """What transformers generates for one image asked the default instruction, greedily, by its own calls."""
    processor = AutoProcessor.from_pretrained(model_folder)
    model = AutoModelForImageTextToText.from_pretrained(model_folder, dtype=torch.float32)
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CHAT_INSTRUCTION}]}]
    prompt = processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[Image.open(image_path).convert("RGB")], return_tensors="pt")
    ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[:, inputs["input_ids"].shape[1] :]
    return " ".join(processor.batch_decode(ids, skip_special_tokens=True)[0].split())


def test_each_image_gets_what_the_model_says_of_it_alone(captioner_model, images, capsys):
    arguments = ["caption", str(images), "--model", str(captioner_model), "--max-new-tokens", str(NEW_TOKENS)]
    assert main([*arguments, "--batch-size", "3"]) == 0  # a batch of three sizes: padded on the left
    assert "captioned 3 image(s)" in capsys.readouterr().out
    assert not (images / "control" / "a.txt").exists()  # a control is no training image
    trained = [path for path in images.rglob("*.png") if path.parent.name != "control"]
    written = {path: path.with_suffix(".txt").read_text(encoding="utf-8") for path in trained}
    assert written.pop(images / "c.png") == "mine, by hand\n"  # already captioned: kept
    captions = {path: _alone(captioner_model, path) for path in written}
    assert written == {path: caption + "\n" for path, caption in captions.items()}
    assert len(set(captions.values())) > 1, "the micro model says the same of every image: the test would see nothing"

    captioner = load_captioner(str(captioner_model))
    assert captioner.prompt() == (
        f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{CHAT_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    assert main([*arguments, "--overwrite"]) == 0
    assert (images / "c.txt").read_text(encoding="utf-8") == _alone(captioner_model, images / "c.png") + "\n"


def test_metadata_lines_are_added_kept_and_read_by_the_scan(captioner_model, images):
    (images / "c.txt").unlink()
    kept = {"file_name": "c.png", "text": "mine, by hand", "control_files": ["control/a.png"]}
    (images / "metadata.jsonl").write_text(json.dumps(kept) + "\n", encoding="utf-8")
    arguments = ["caption", str(images), "--model", str(captioner_model), "--max-new-tokens", str(NEW_TOKENS)]
    assert main([*arguments, "--metadata"]) == 0
    lines = [json.loads(line) for line in (images / "metadata.jsonl").read_text(encoding="utf-8").splitlines()]
    assert lines[0] == kept  # what was there stays whole, first
    assert [line["file_name"] for line in lines] == ["c.png", "a.png", "b.png"]
    more = json.loads((images / "2_more" / "metadata.jsonl").read_text(encoding="utf-8"))  # each folder its own
    assert more["file_name"] == "d.png" and more["text"] == _alone(captioner_model, images / "2_more" / "d.png")
    assert not list(images.rglob("*.txt"))
    examples, bad = scan_examples(DataConfig(path=str(images)))
    assert not bad and {e.path.name: e.caption for e in examples} == {
        "c.png": "mine, by hand",
        "a.png": lines[1]["text"],
        "b.png": lines[2]["text"],
        "d.png": more["text"],
    }


def test_a_model_that_is_not_a_captioner_is_refused(tiny_base, images, capsys):
    assert main(["caption", str(images), "--model", str(tiny_base / "unet")]) == 2
    assert "not a vision-language model transformers loads" in capsys.readouterr().err
    assert not (images / "a.txt").exists()


def test_the_ui_captions_the_uncaptioned_images_of_a_dataset_it_may_edit(captioner_model, images, tmp_path):
    from difftune.webui import datasets

    data = DataConfig(path=str(images))
    with pytest.raises(DifftuneError, match="outside the folders"):
        datasets.caption_uncaptioned(data, str(captioner_model), False, [tmp_path / "elsewhere"])
    assert [item.name for item in datasets.list_items(data) if item.caption is None] == ["a.png", "b.png", "d.png"]
    report = datasets.caption_uncaptioned(data, str(captioner_model), False, [tmp_path], NEW_TOKENS)
    assert (report.written, report.kept) == (3, 1)
    captions = {item.name: item.caption for item in datasets.list_items(data)}
    assert captions["c.png"] == "mine, by hand"
    assert captions["a.png"] == _alone(captioner_model, images / "a.png")
    assert captions["d.png"] == _alone(captioner_model, images / "2_more" / "d.png")
