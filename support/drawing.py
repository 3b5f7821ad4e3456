"""
Pictures of what the code computes, drawn from its own output (needs matplotlib):

    plot_decode     one decode: the step that committed each response position (--plot=decode.png)
    animate_decode  the same decode as an animated GIF, a frame per step (--plot=decode.gif)
    plot_layout     ReFusion's training buffer and its labels (SPEC 3)
    picture_path    the file a --plot flag names, checked before any work

python -m tools.figures draws the pictures of docs/ with them.
"""

import os
import sys
import tempfile

import torch

from data import IGNORE
from support.files import write_atomic
from support.tokenizer import decode

PARTS = {"prompt": "tab:gray", "clean slot": "tab:blue", "masked slot": "tab:orange",
         "padding": "whitesmoke"}
TERMS = {"no label": "white", "AR loss: next token in the slot": "tab:green",
         "MDM loss: the masked token itself": "tab:red"}


def pyplot():
    """matplotlib.pyplot, drawing to files only (Agg). Raises ValueError saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("drawing a picture needs matplotlib: pip install matplotlib") from None
    return plt


def picture_path(path, flag, extensions=(".png",)):
    """The file `flag`=path writes: path when it ends in one of extensions, path + extensions[0]
    without one. Raises ValueError for another extension, a directory or a folder that cannot be
    written, FileNotFoundError when its folder does not exist."""
    if os.path.isdir(path):
        raise ValueError(f"{flag}={path} is a directory; name a file, e.g. {flag}="
                         f"{os.path.join(path, 'decode' + extensions[0])}")
    folder, name = os.path.split(path)
    if name.lower() in extensions:                     # ".gif": an extension, no name
        raise ValueError(f"{flag}={path}: name the file, e.g. {flag}="
                         f"{os.path.join(folder, 'decode' + name)}")
    stem, extension = os.path.splitext(path)
    if extension.lower() not in ("", *extensions):
        names = " or ".join(stem + e for e in extensions)
        kinds = " or ".join(e[1:].upper() for e in extensions)
        raise ValueError(f"{flag}={path}: pictures are {kinds} files; name it {names}")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{flag}={path}: the directory {folder} does not exist; create it "
                                "or pick another path")
    try:  # a file can be made there (the picture is written atomically beside where it goes)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{flag}={path}: cannot write in {folder} ({e.strerror or e}); pick "
                         "another path") from None
    return path if extension else path + extensions[0]


def save_png(fig, path):
    """Write fig as a PNG to exactly `path`, atomically (support.files.write_atomic)."""
    write_atomic(path, lambda f: fig.savefig(f, dpi=100, format="png"))


def cell_text(enc, token, eos_ids, mask_id=None):
    """A token as a cell shows it: EOS ■, the mask ░, newline ↵, space ␣, else at most 3 characters
    of its text."""
    if token in eos_ids:
        return "■"
    if token == mask_id:
        return "░"
    return decode(enc, [token]).replace("\n", "↵").replace(" ", "␣")[:3]


def plot_decode(out, prompt_len, path, title="", texts=None, canvas=0):
    """Draw the Generation `out` as a PNG at path and return the Figure: response position against
    decoding step, each position coloured by the step that committed it, each step's forward passes
    in the margin, a dashed line where the returned response ends. texts: {position: str} drawn in
    the committing cell; canvas: the fewest response positions drawn (gen_length). Raises
    ValueError without matplotlib."""
    plt = pyplot()
    import numpy as np
    from matplotlib.ticker import MaxNLocator
    step_of = committing_steps(out, prompt_len, canvas)    # (width,)
    width, n = len(step_of), len(out.trace)
    steps = np.arange(1, n + 1)[:, None]                   # (n, 1) the step of each row
    by_step = np.broadcast_to(step_of, (n, width))         # (n, width)
    # committed by step s
    committed = np.ma.masked_where((by_step == 0) | (by_step > steps), by_step)
    new = np.ma.masked_where(by_step != steps, by_step)    # committed at step s
    fig, ax = plt.subplots(figsize=(min(2.5 + 0.17 * width, 18), min(1.8 + 0.2 * n, 18)))
    style = dict(cmap="viridis", vmin=1, vmax=max(n, 2), aspect="auto", interpolation="nearest",
                 extent=(-0.5, width - 0.5, n + 0.5, 0.5))
    ax.imshow(committed, alpha=0.3, **style)
    image = ax.imshow(new, **style)
    for s, k in enumerate(out.step_nfe, 1):
        ax.text(1.01, s, f"{k} fwd", transform=ax.get_yaxis_transform(), va="center", fontsize=7)
    for p, text in (texts or {}).items():
        s = step_of[p - prompt_len]
        # viridis runs from dark blue to light yellow
        light = image.norm(s) > 0.6
        ax.text(p - prompt_len, s, text, ha="center", va="center", fontsize=6,
                color="black" if light else "white", parse_math=False)
    ax.axvline(len(out.tokens) - 0.5, color="tab:red", linestyle="--", linewidth=1)
    ax.set_xlabel("response position (dashed: end of the returned response)")
    ax.set_ylabel("decoding step")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title, fontsize=9, loc="left")
    bar = fig.colorbar(image, ax=ax, pad=0.08, label="committing step")
    bar.locator = MaxNLocator(integer=True)                # steps are whole numbers
    fig.tight_layout()
    save_png(fig, path)
    return fig


def committing_steps(out, prompt_len, canvas=0):
    """(width,) int64 numpy array: the step (from 1) that committed each response position of out,
    0 for none; width: canvas or the last committed position + 1, whichever is larger."""
    import numpy as np
    width = max(canvas, max(p for step in out.trace for p, _ in step) - prompt_len + 1)
    step_of = np.zeros(width, dtype=np.int64)
    for s, step in enumerate(out.trace, 1):
        for p, _ in step:
            step_of[p - prompt_len] = s
    return step_of


MAX_FRAMES = 64  # a longer decode's GIF shows several steps a frame (animate_decode)
FRAME_MS = 600   # how long a GIF shows a frame, the last three times as long


def animate_decode(out, prompt_len, path, title="", texts=None, canvas=0, per_row=32):
    """Draw the Generation `out` as an animated GIF at path, a frame per decoding step (at most
    MAX_FRAMES, a note on stderr when steps are merged): the response positions in rows of per_row,
    coloured as plot_decode once committed, those new in the frame outlined in red. texts, canvas:
    as plot_decode. Returns (the frames as RGB PIL images, their captions). Raises ValueError
    without matplotlib."""
    plt = pyplot()
    import numpy as np
    from matplotlib.patches import Rectangle
    from PIL import Image
    step_of = committing_steps(out, prompt_len, canvas)
    width, n = len(step_of), len(out.trace)
    # the step each frame ends at: every step, or MAX_FRAMES of them spread evenly
    ends = list(range(1, n + 1)) if n <= MAX_FRAMES else \
        [round(k * n / MAX_FRAMES) for k in range(1, MAX_FRAMES + 1)]
    if n > MAX_FRAMES:
        print(f"note: {n} decoding steps drawn as {MAX_FRAMES} frames of about "
              f"{n / MAX_FRAMES:.1f} steps each", file=sys.stderr)
    per_row = min(per_row, width)
    rows = -(-width // per_row)
    grid = np.zeros(rows * per_row, dtype=np.int64)
    grid[:width] = step_of
    fig, ax = plt.subplots(figsize=(1.0 + 0.32 * per_row, 1.3 + 0.42 * rows))
    cmap = plt.get_cmap("viridis").with_extremes(bad="gainsboro")
    frames, captions = [], []
    for first, s in zip([1] + [e + 1 for e in ends[:-1]], ends):
        ax.clear()
        shown = np.ma.masked_where((grid == 0) | (grid > s), grid).reshape(rows, per_row)
        ax.imshow(shown, cmap=cmap, vmin=1, vmax=max(n, 2), aspect="auto",
                  interpolation="nearest")
        for i in range(width):
            r, c, committed = i // per_row, i % per_row, 0 < step_of[i] <= s
            light = committed and (step_of[i] - 1) / max(n - 1, 1) > 0.6
            text = (texts or {}).get(prompt_len + i, "") if committed else "░"
            ax.text(c, r, text, ha="center", va="center", fontsize=7, parse_math=False,
                    color="black" if light or not committed else "white")
            if first <= step_of[i] <= s:
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red",
                                       linewidth=1.5))
        ax.set_xticks([])
        ax.set_yticks(range(rows), [f"{r * per_row}" for r in range(rows)], fontsize=7)
        done = int(((step_of > 0) & (step_of <= s)).sum())
        steps = f"step {s}" if first == s else f"steps {first} to {s}"
        new = sum(len(step) for step in out.trace[first - 1:s])
        captions.append(f"{steps} of {n}: {new} committed (red), {done} of "
                        f"{width} in all, {sum(out.step_nfe[:s])} forward passes so far")
        ax.set_title(f"{title}\n{captions[-1]}", fontsize=8, loc="left")
        fig.tight_layout()
        fig.canvas.draw()
        frames.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB"))
    plt.close(fig)
    durations = [FRAME_MS] * (len(frames) - 1) + [3 * FRAME_MS]
    write_atomic(path, lambda f: frames[0].save(f, format="GIF", save_all=True, loop=0,
                                                append_images=frames[1:], duration=durations))
    return frames, captions


def layout_codes(batch, prompt_len, length, mask_id):
    """(part, term), each (B, T) int64, of every buffer place of a Batch: part 0 prompt, 1 clean
    slot, 2 masked slot, 3 padding; term 0 no label, 1 AR label, 2 MDM label."""
    pos = batch.position_ids
    part = torch.where(pos < prompt_len[:, None], 0,
                       torch.where(pos >= length[:, None], 3,
                                   torch.where(batch.idx == mask_id, 2, 1)))
    term = torch.where(batch.labels == IGNORE, 0, torch.where(batch.mdm_weight > 0, 2, 1))
    return part, term


def plot_layout(batch, prompt_len, length, slot_size, mask_id, path, texts=None, title=""):
    """Draw row 0 of a reorganized Batch as a PNG at path and return the Figure: true position
    against buffer place, then the inputs by part and the labels by loss term (layout_codes).
    prompt_len, length: (B,) int64, as reorganize_slots takes them; slot_size: row 0's. texts:
    (input texts, label texts), a str per buffer place. Raises ValueError without matplotlib."""
    plt = pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    part, term = (x[0].tolist() for x in layout_codes(batch, prompt_len, length, mask_id))
    pos, P, T = batch.position_ids[0].tolist(), int(prompt_len[0]), len(part)
    fig, (top, fed, labels) = plt.subplots(3, 1, sharex=True, figsize=(2 + 0.22 * T, 5.2),
                                           gridspec_kw=dict(height_ratios=[5, 1, 1]))
    colors = list(PARTS.values())
    top.scatter(range(T), pos, c=[colors[k] for k in part], s=14, zorder=2)
    top.set_ylabel("true position (position id)")
    slot = [(q - P) // slot_size if k in (1, 2) else None for q, k in zip(pos, part)]
    for i in range(T):                          # name each slot above its first token in the buffer
        if slot[i] is not None and (i == 0 or slot[i - 1] != slot[i]):
            top.text(i - 0.4, pos[i] + 1.5, f"slot {slot[i]}", fontsize=7, rotation=90, va="bottom")
            top.axvline(i - 0.5, color="lightgray", linewidth=0.8, zorder=1)
    top.set_ylim(-1, max(pos) + 8)
    top.legend(handles=[Patch(color=c, label=n) for n, c in PARTS.items()], fontsize=7,
               loc="upper left", ncol=4)
    top.set_title(title, fontsize=9, loc="left")
    fed_texts, label_texts = texts or ([], [])
    for ax, codes, names, row_texts in ((fed, part, PARTS, fed_texts),
                                        (labels, term, TERMS, label_texts)):
        ax.imshow([codes], cmap=ListedColormap(list(names.values())), vmin=0, vmax=len(names) - 1,
                  aspect="auto", interpolation="nearest", extent=(-0.5, T - 0.5, 0.5, -0.5))
        ax.set_yticks([])
        for i, text in enumerate(row_texts):
            ax.text(i, 0, text, ha="center", va="center", fontsize=7, parse_math=False)
    fed.set_ylabel("input", rotation=0, ha="right", va="center")
    labels.set_ylabel("label", rotation=0, ha="right", va="center")
    labels.legend(handles=[Patch(facecolor=c, edgecolor="gray", label=n)
                           for n, c in TERMS.items()], fontsize=7,
                  loc="upper left", bbox_to_anchor=(0, -0.9), ncol=3)
    labels.set_xlabel("place in the buffer (what the model reads, left to right, "
                      "with causal attention)")
    fig.tight_layout()
    save_png(fig, path)
    return fig
