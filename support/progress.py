"""
train.py's progress bar: tqdm's bar with the loss and the speed of the last interval (tokens/s,
TFLOP/s, and MFU on CUDA), or, off a terminal, a line every log_interval steps. Time spent
compiling or evaluating is never counted as training.

    Rates      tokens/s and FLOP/s over the last interval, on any clock
    Progress   what the training loop calls: iterate it for the steps; write, skip, step_begins,
               step_ends
"""

import sys
import time

import torch
from tqdm import tqdm

# seconds between two redraws of the progress bar, and the least training its speed is taken over
BAR_SECONDS = 1.0


class Rates:
    """Tokens/s and FLOP/s over the last interval of training: the steps counted since the last
    take(), over the seconds they took on clock (a function returning seconds: time.perf_counter, or
    a test's). What skip() leaves out is in neither: an evaluation and its checkpoint, a step that
    compiled. Tokens and FLOPs are those of every process."""

    def __init__(self, clock):
        self.clock = clock
        self.mark = clock()  # the end of what was last counted or skipped
        self.tokens = 0
        self.flops = 0
        self.seconds = 0.0   # counted since the last take()

    def _lap(self):
        """The seconds since the mark; the mark moves to now."""
        now = self.clock()
        seconds = now - self.mark
        self.mark = now
        return seconds

    def count(self, tokens, flops):
        """A step that ended now: its tokens and FLOPs, over the seconds since the mark."""
        self.seconds += self._lap()
        self.tokens += tokens
        self.flops += flops

    def skip(self):
        """Leave the seconds since the mark out of every rate; returns them."""
        return self._lap()

    def take(self):
        """(tokens/s, FLOP/s) of the interval, which then starts again; None when it counted no
        time (its steps all compiled)."""
        rates = None
        if self.seconds > 0:
            rates = (self.tokens / self.seconds, self.flops / self.seconds)
        self.tokens = 0
        self.flops = 0
        self.seconds = 0.0
        return rates


def compiled_frames(cfg):
    """How many frames torch.compile has compiled in this process so far (0 without --compile): a
    step during which the count grew spent time compiling (the first one, a new sequence length)."""
    if not cfg["compile"]:
        return 0
    return torch._dynamo.utils.counters["frames"]["total"]


class Progress:
    """The steps of a run from iter_num to cfg["max_iters"], as train.py's loop iterates them,
    with the bar (rank 0, on a terminal) or the lines (rank 0, off one) that show them. cfg: the
    run's settings (max_iters, log_interval, compile, device, peak_tflops); world: the processes,
    whose tokens and FLOPs each step's are multiplied by."""

    def __init__(self, cfg, iter_num, rank, world):
        self.cfg = cfg
        self.start = iter_num
        self.rank = rank
        self.world = world
        # where tqdm redraws its bar in place; elsewhere a line every log_interval steps
        self.live = sys.stdout.isatty() and sys.stderr.isatty()
        self.bar = tqdm(range(iter_num, cfg["max_iters"]), initial=iter_num,
                        total=cfg["max_iters"], desc="train", mininterval=BAR_SECONDS,
                        disable=rank != 0 or not self.live)
        self.rates = Rates(time.perf_counter)
        self.frames = 0

    def __iter__(self):
        """The iterations to run, iter_num to max_iters - 1, through the bar."""
        return iter(self.bar)

    def write(self, text):
        """Print a line above the bar (rank 0 only)."""
        if self.rank == 0:
            tqdm.write(text)

    def skip(self):
        """Leave the time since the last step out of tokens/s (an evaluation, a checkpoint)."""
        self.rates.skip()

    def step_begins(self):
        """Note what torch.compile has compiled so far, to tell a step that compiled."""
        self.frames = compiled_frames(self.cfg)

    def step_ends(self, it, losses, tokens, flops):
        """Step `it` ended now: losses (loss, ar_loss, mdm_loss) floats; tokens and flops this
        process's. A step that compiled is left out of the speed (the first one's time said
        once); then the bar or the line shows it (show)."""
        if compiled_frames(self.cfg) > self.frames:
            seconds = self.rates.skip()
            if it == self.start:
                self.write(f"compile: first step took {seconds:.1f} s (not counted in tokens/s)")
        else:
            self.rates.count(tokens * self.world, flops * self.world)
        self.show(it, losses)

    def show(self, it, losses):
        """Show a step's losses and the speed of the last interval (Rates) on the bar, once
        BAR_SECONDS of training were counted; off a terminal, print a line every log_interval
        steps instead (without the speed when none was counted: the steps since the last line all
        compiled)."""
        lines = not self.live and self.rank == 0
        loss, ar_loss, mdm_loss = losses
        if lines:
            due = it % self.cfg["log_interval"] == 0
        else:
            due = self.rates.seconds >= BAR_SECONDS
        if not due:
            return
        shown = {"loss": f"{loss:.3f}", "ar": f"{ar_loss:.3f}", "mdm": f"{mdm_loss:.3f}"}
        line = f"iter {it}: loss {loss:.4f} (ar {ar_loss:.4f}, mdm {mdm_loss:.4f})"
        speed = self.rates.take()
        if speed is not None:
            tokens_per_s, flops_per_s = speed
            tflops = flops_per_s / 1e12
            shown |= {"tok_s": f"{tokens_per_s:.0f}", "tflops": f"{tflops:.3f}"}
            line += f", {tokens_per_s:.0f} tok/s, {tflops:.3f} TFLOP/s"
            # the share of the GPUs' bf16 peak
            if "cuda" in self.cfg["device"]:
                shown["mfu"] = f"{tflops / (self.cfg['peak_tflops'] * self.world):.1%}"
                line += f", MFU {shown['mfu']}"
        self.bar.set_postfix(shown)
        if lines:
            print(line, flush=True)

    def close(self):
        """End the bar (its last frame stays on the terminal)."""
        self.bar.close()
