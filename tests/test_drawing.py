"""The pictures (support/drawing.py: sampler.py --plot, python -m tools.figures): each draws the
decoder's or the layout's own output."""

import json
import os

import numpy as np
import pytest
import torch

import sampler
import train
from data import layout_slots
from helpers import qa_rows, tiny_model, tiny_run_flags, write
from support import drawing
from sampler import DECODERS
from support.drawing import picture_path, plot_decode, pyplot
from tools import figures

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("method", ["refusion", "next_token", "mdm"])
def test_decode_picture_draws_each_step_of_the_trace(tmp_path, method):
    """Row s holds exactly the positions step s committed (full colour, value s) on top of every
    position committed by step s (faded); the margin gives each step's forward passes, which add
    up to the decode's NFE."""
    generate, Settings = DECODERS[method]
    knobs = (dict(slot_size=4, serial_num_blocks=2, slot_threshold=0.0, token_threshold=0.05)
             if method == "refusion" else {})
    kwargs = dict(eos_ids=(-1,)) | ({} if method == "next_token" else dict(mask_id=38))
    out = generate(tiny_model(causal=method != "mdm"), [1, 2, 3], Settings(16, **knobs), **kwargs)
    assert (sum(out.step_nfe) == out.nfe and len(out.step_nfe) == len(out.trace) and
            min(out.step_nfe) >= 1)
    texts = {p: str(t) for step in out.trace for p, t in step}
    fig = plot_decode(out, 3, tmp_path / "decode.png", texts=texts,
                      canvas=Settings(16, **knobs).gen_length)
    assert (tmp_path / "decode.png").read_bytes().startswith(PNG)
    ax = fig.axes[0]
    committed, new = (image.get_array() for image in ax.images)
    assert new.shape == (len(out.trace), 16)
    done = set()
    for s, step in enumerate(out.trace, 1):
        done |= {p - 3 for p, _ in step}
        assert set(np.flatnonzero(~np.ma.getmaskarray(new[s - 1]))) == {p - 3 for p, _ in step}
        assert set(np.flatnonzero(~np.ma.getmaskarray(committed[s - 1]))) == done
        assert (new[s - 1].compressed() == s).all()
    margin = [t.get_text() for t in ax.texts if t.get_text().endswith(" fwd")]
    assert margin == [f"{k} fwd" for k in out.step_nfe]
    pyplot().close(fig)


@pytest.mark.parametrize("method", ["refusion", "next_token", "mdm"])
def test_decode_animation_has_a_frame_per_step_counting_the_trace(tmp_path, method):
    """--plot=*.gif: the GIF holds one frame per decoding step, each captioned with that step's
    committed tokens, all committed so far and the forward passes so far, as counted here from the
    trace; consecutive frames differ (each step commits something)."""
    from PIL import Image
    generate, Settings = DECODERS[method]
    knobs = (dict(slot_size=4, serial_num_blocks=2, slot_threshold=0.0, token_threshold=0.05)
             if method == "refusion" else {})
    kwargs = dict(eos_ids=(-1,)) | ({} if method == "next_token" else dict(mask_id=38))
    out = generate(tiny_model(causal=method != "mdm"), [1, 2, 3], Settings(16, **knobs), **kwargs)
    frames, captions = drawing.animate_decode(out, 3, tmp_path / "decode.gif", canvas=16,
                                              per_row=8)
    gif = Image.open(tmp_path / "decode.gif")
    assert gif.format == "GIF" and gif.n_frames == len(out.trace) == len(frames)
    n, done, passes = len(out.trace), 0, 0
    for s, (step, k) in enumerate(zip(out.trace, out.step_nfe), 1):
        done, passes = done + len(step), passes + k
        assert captions[s - 1] == (f"step {s} of {n}: {len(step)} committed (red), {done} of 16 "
                                   f"in all, {passes} forward passes so far")
    assert all(np.asarray(a).tobytes() != np.asarray(b).tobytes()
               for a, b in zip(frames, frames[1:]))


def test_a_long_decodes_animation_is_capped_with_a_note(tmp_path, capsys, monkeypatch):
    """A decode of more steps than MAX_FRAMES is drawn in MAX_FRAMES frames (here 4 for 16
    steps), each covering its steps, the last one the decode's end, and a note says so: a GIF
    costs its frames times the positions, not the steps squared."""
    from PIL import Image
    monkeypatch.setattr(drawing, "MAX_FRAMES", 4)
    out = DECODERS["next_token"][0](tiny_model(), [1, 2, 3], DECODERS["next_token"][1](16),
                                    eos_ids=(-1,))
    assert len(out.trace) == 16
    frames, captions = drawing.animate_decode(out, 3, tmp_path / "long.gif", per_row=8)
    assert Image.open(tmp_path / "long.gif").n_frames == len(frames) == 4
    assert captions == [f"steps {a} to {b} of 16: 4 committed (red), {b} of 16 in all, {b} "
                        "forward passes so far" for a, b in ((1, 4), (5, 8), (9, 12), (13, 16))]
    assert "note: 16 decoding steps drawn as 4 frames of about 4.0 steps each" in \
        capsys.readouterr().err


def test_layout_picture_draws_the_reorganized_buffer(tmp_path):
    """Prompt [10, 11], response [1, 2, 3, 4, 5, EOS] in slots of 2 (slot 1 masked, clean slots in
    the order 2, 0), two pads: the points are (buffer place, position id), the input strip gives
    each place's part and the label strip its loss term, all as a hand-computed layout says."""
    E, M, PAD_ID = 256, 257, 258
    tokens = torch.tensor([[10, 11, 1, 2, 3, 4, 5, E, PAD_ID, PAD_ID]])
    prompt_len, length = torch.tensor([2]), torch.tensor([8])
    batch = layout_slots(tokens, prompt_len, length, S=torch.tensor([2]), p=torch.tensor([0.5]),
                         slot_is_masked=torch.tensor([[False, True, False] + [False] * 7]),
                         slot_rank=torch.tensor([[1, 2, 0] + list(range(3, 10))]), mask_id=M)
    fig = drawing.plot_layout(batch, prompt_len, length, 2, M, tmp_path / "layout.png")
    assert (tmp_path / "layout.png").read_bytes().startswith(PNG)
    top, fed, labels = fig.axes
    assert (top.collections[0].get_offsets().tolist() ==
            [[i, q] for i, q in enumerate([0, 1, 6, 7, 2, 3, 4, 5, 8, 9])])
    # parts: prompt 0, clean slot 1, masked slot 2, padding 3; terms: none 0, AR 1, MDM 2
    assert fed.images[0].get_array().tolist() == [[0, 0, 1, 1, 1, 1, 2, 2, 3, 3]]
    assert labels.images[0].get_array().tolist() == [[0, 0, 1, 0, 1, 0, 2, 2, 0, 0]]
    assert [t.get_text() for t in top.texts] == ["slot 2", "slot 0", "slot 1"]
    pyplot().close(fig)


def test_figures_script_draws_both_pictures_from_a_real_sample_and_checkpoint(tmp_path, qa_file,
                                                                              capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    layout, decode = tmp_path / "layout.png", tmp_path / "decode.png"
    figures.main([f"--dataset={qa_file[0]}", "--block_size=64", f"--data_root={tmp_path / 'data'}",
                  "--sample=0", "--slot_size=2", f"--layout_png={layout}",
                  f"--out_dir={tmp_path / 'run'}", f"--decode_png={decode}",
                  "--sampler_flags=--max_new_tokens=8 --slot_size=4 --serial_num_blocks=1 --json"])
    assert layout.read_bytes().startswith(PNG) and decode.read_bytes().startswith(PNG)
    printed = capsys.readouterr().out.splitlines()
    # the decode drawn
    assert json.loads(next(line for line in printed if line.startswith("{")))["tokens"] >= 1
    with pytest.raises(ValueError, match="--sample=999: the validation split holds"):
        figures.main([f"--dataset={qa_file[0]}", "--block_size=64",
                      f"--data_root={tmp_path / 'data'}", "--sample=999", f"--layout_png={layout}"])


@pytest.mark.parametrize("name, written", [("decode.png", "decode.png"), ("decode", "decode.png")])
def test_plot_names_the_png_it_writes_and_refuses_a_bad_path_before_any_work(tmp_path, capsys,
                                                                            name, written):
    (tmp_path / "d.png").mkdir()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    bad_paths = [(tmp_path / "d.png", "is a directory"), (tmp_path / "d.jpg", "name it"),
                 (tmp_path / "none" / "d.png", "does not exist"),
                 (tmp_path / ".gif", r"name the file, e\.g\. --plot=.*decode\.gif")]
    if not os.access(locked, os.W_OK):  # root writes anywhere: no such directory for it
        bad_paths.append((locked / "d.gif", "cannot write in"))
    for bad, message in bad_paths:
        with pytest.raises((ValueError, FileNotFoundError), match=message):  # no checkpoint read
            sampler.main([f"--out_dir={tmp_path / 'no-model-here'}", f"--plot={bad}"])
    if os.path.isdir("/proc"):                             # a directory nobody can write in
        with pytest.raises(ValueError, match="cannot write in /proc"):
            picture_path("/proc/d.png", "--plot")
    data = write(tmp_path, "qa.json", json.dumps(qa_rows()))
    train.main(tiny_run_flags(tmp_path, (data,), "m") + ["--max_iters=2"])
    capsys.readouterr()
    sampler.main([f"--out_dir={tmp_path / 'm'}", "--num_samples=1", "--max_new_tokens=8",
                  "--slot_size=4", f"--plot={tmp_path / name}"])
    assert f"into {tmp_path / written}" in capsys.readouterr().err
    assert (tmp_path / written).read_bytes().startswith(PNG)
    assert not (tmp_path / f"{written}.png").exists()
