"""
train.py's progress bar: tqdm's bar with the loss and the speed of the last interval (tokens/s,
TFLOP/s, MFU on CUDA), or off a terminal a line every log_interval steps. Compiling and evaluating
are not counted as training.

    Rates      tokens/s and FLOP/s over the last interval, on any clock
    Progress   the training loop's steps: iterate it; write, skip, step_begins, step_ends
"""

import sys
import time

import torch
from tqdm import tqdm

# seconds between two redraws of the progress bar, and the least training its speed is taken over
BAR_SECONDS = 1.0


class Rates:
    """Tokens/s and FLOP/s of the steps counted since the last take(), over the seconds they took
    on clock (a function returning seconds); time skip() leaves out is in neither."""

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
        """Count a step that ended now: its tokens and FLOPs, over the seconds since the mark."""
        self.seconds += self._lap()
        self.tokens += tokens
        self.flops += flops

    def skip(self):
        """Leave the seconds since the mark out of every rate; returns them."""
        return self._lap()

    def take(self):
        """(tokens/s, FLOP/s) of the interval, which then starts again; None when it counted no
        time."""
        rates = None
        if self.seconds > 0:
            rates = (self.tokens / self.seconds, self.flops / self.seconds)
        self.tokens = 0
        self.flops = 0
        self.seconds = 0.0
        return rates


def compiled_frames(cfg):
    """The frames torch.compile has compiled in this process so far (0 without --compile)."""
    if not cfg["compile"]:
        return 0
    return torch._dynamo.utils.counters["frames"]["total"]


class Progress:
    """The steps from iter_num to cfg["max_iters"], shown by rank 0 on a bar (on a terminal) or in
    lines. cfg: max_iters, log_interval, compile, device, peak_tflops; world: the processes, by
    which a step's tokens and FLOPs are multiplied."""

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
        process's. A step that compiled is left out of the speed; then show."""
        if compiled_frames(self.cfg) > self.frames:
            seconds = self.rates.skip()
            if it == self.start:
                self.write(f"compile: first step took {seconds:.1f} s (not counted in tokens/s)")
        else:
            self.rates.count(tokens * self.world, flops * self.world)
        self.show(it, losses)

    def show(self, it, losses):
        """Show a step's losses and the interval's speed on the bar once BAR_SECONDS were counted;
        off a terminal, print a line every log_interval steps."""
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
