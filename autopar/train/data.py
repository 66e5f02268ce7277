"""Training data: which samples each step reads, on every layout alike.

The order of samples is a property of the run, not of its layout: a seeded
permutation of the dataset per epoch, cut into global batches of the plan's
size. Step k always trains on global batch k; a data-parallel rank reads only
its contiguous share of it (the share `ParallelModel` would cut from the whole
batch), so dp 4 and pp 2 x tp 2 see the same samples at the same step, and a
snapshot's data position is one number (the step), valid under any plan.

Sources:
  TokenFile      a flat binary of token ids (uint16 / uint32, as nanoGPT's and
                 Megatron's tokenization scripts write them), read by memory
                 map; sample i = tokens [i s, i s + s] and the next-token targets
  a Dataset      a model file's `dataset()`: any torch Dataset of
                 (inputs, targets) with inputs a tensor or a tuple of tensors
  Synthetic      random tokens from the model's example inputs (`--synthetic`)
  StripeImages   a stand-in image set (gratings by class) for vision examples
"""
from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import Dataset

from autopar.errors import AutoparError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


class TokenFile(Dataset):
    """Non-overlapping windows of `seq_len` tokens from a flat token file; targets
    are the same window shifted by one (next-token prediction). The file is memory
    mapped: a rank touches only the pages of its own samples. `shift=False`: targets
    are the inputs themselves (a Hugging Face causal LM shifts its labels itself)."""

    # a file up to this many tokens is scanned for its largest id when it is opened (a
    # second or so); a larger one is checked sample by sample as it is read
    SCAN_TOKENS = 1 << 28

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16", shift: bool = True,
                 vocab_size: int | None = None):
        if dtype not in TOKEN_DTYPES:
            raise AutoparError(f"--data-dtype {dtype}: unknown", hint=f"choose from {', '.join(TOKEN_DTYPES)}")
        if not os.path.isfile(path):
            raise AutoparError(f"--data {path}: no such file")
        size = os.path.getsize(path)
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        if size % itemsize:
            raise AutoparError(f"--data {path}: {size} bytes is not a whole number of {dtype} tokens",
                               hint="check --data-dtype (uint16 for vocabularies up to 65,536, else uint32)")
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
        self.seq_len = seq_len
        self.path, self.dtype, self.shift = path, dtype, shift
        if len(self) < 1:
            raise AutoparError(f"--data {path}: {len(self.tokens)} tokens, fewer than one sample of "
                               f"{seq_len + 1} (the plan's sequence length + 1 target)")
        self.vocab_size = vocab_size
        if vocab_size is not None and len(self.tokens) <= self.SCAN_TOKENS:
            self._check_ids(self.tokens, 0)

    def _check_ids(self, ids, offset: int) -> None:
        """Refuse token ids the model's vocabulary has no row for (an embedding lookup
        would fail on one rank with a bare IndexError), naming the first one's place."""
        chunk = 1 << 24
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            bad = np.flatnonzero(part >= self.vocab_size)
            if len(bad):
                at = offset + start + int(bad[0])
                raise AutoparError(
                    f"--data {self.path}: token {int(part[bad[0]])} at token offset {at} (byte "
                    f"{at * self.tokens.itemsize}) is outside the model's vocabulary of {self.vocab_size}",
                    hint="was the file made with this model's tokenizer, and is --data-dtype right?")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int):
        s = self.seq_len
        ids = self.tokens[i * s: i * s + s + 1]
        if self.vocab_size is not None and len(self.tokens) > self.SCAN_TOKENS:
            self._check_ids(ids, i * s)
        window = torch.from_numpy(ids.astype(np.int64))
        return (window[:-1],), (window[1:] if self.shift else window[:-1])


class BatchSizes:
    """The global batch of each step: `final` from the start, or, with a ramp
    (`--batch-ramp START:STEPS`, as Megatron's --rampup-batch-size and GPT-3's
    batch warmup), growing linearly from `start` to `final` over `steps` steps, each
    step's batch a whole multiple of `quantum` (micro-batch x dp: whole micro-batches
    on every data-parallel rank)."""

    def __init__(self, final: int, quantum: int, start: int | None = None, steps: int = 0):
        if final % quantum:
            raise AutoparError(f"global batch {final} is not a whole number of micro-batches x dp = {quantum}")
        self.final, self.quantum = final, quantum
        self.start, self.steps = (start, steps) if start is not None and steps > 0 else (final, 0)
        if self.steps and not quantum <= self.start <= final:
            raise AutoparError(f"--batch-ramp starts at {start} samples; it must lie in [{quantum}, {final}] "
                               f"(micro-batch x dp = {quantum}, the run's global batch {final})")
        self._consumed = [0]  # samples read before each ramp step

    @property
    def ramped(self) -> bool:
        return self.steps > 0

    def size(self, step: int) -> int:
        if step >= self.steps:
            return self.final
        exact = self.start + (self.final - self.start) * step / self.steps
        return max(self.quantum, int(exact) // self.quantum * self.quantum)

    def consumed(self, step: int) -> int:
        """Samples the steps before `step` read."""
        while len(self._consumed) <= min(step, self.steps):
            k = len(self._consumed) - 1
            self._consumed.append(self._consumed[k] + self.size(k))
        if step <= self.steps:
            return self._consumed[step]
        return self._consumed[self.steps] + (step - self.steps) * self.final

    def to_dict(self) -> dict:
        return {"global_batch": self.final, **({"ramp": f"{self.start}:{self.steps}"} if self.ramped else {})}


class GlobalBatches:
    """Global batch k of a seeded, per-epoch shuffled order; this dp rank's share.

    `batch(step)` -> (inputs tuple, targets) of this rank's `global_batch / dp`
    samples. Stateless in the step: resuming at step k (any layout) reads what an
    uninterrupted run reads at step k. `state_dict()` records what fixes the order
    (seed, dataset size, global batch) so a resume refuses a different one."""

    def __init__(self, dataset, global_batch: int, dp: int, dp_rank: int, seed: int = 0, shuffle: bool = True,
                 sizes: BatchSizes | None = None):
        self.sizes = sizes if sizes is not None and sizes.ramped else None
        if global_batch % dp:
            raise AutoparError(f"global batch {global_batch} does not split over dp={dp} ranks")
        n = len(dataset)
        if n < global_batch:
            raise AutoparError(f"the dataset has {n} samples, fewer than one global batch of {global_batch}",
                               hint="use more data or a smaller --batch-size when planning")
        self.dataset, self.global_batch, self.dp, self.dp_rank = dataset, global_batch, dp, dp_rank
        self.seed, self.shuffle = seed, shuffle
        self.batches_per_epoch = n // global_batch  # the last partial batch of an epoch is dropped
        self._order_epoch, self._order = None, None
        self._quantum = sizes.quantum if sizes is not None else global_batch
        # Where this run's batch sizes begin: the step, and the position in the epochs'
        # orders laid end to end. (0, 0) but in a run resumed at another global batch.
        self.phase = {"step": 0, "offset": 0}

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(n, generator=g)
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        return self._order

    @property
    def _streamed(self) -> bool:
        return self.sizes is not None or self.phase["step"] > 0

    def indices(self, step: int) -> list[int]:
        if self._streamed:
            return self._stream_indices(step)
        epoch, k = divmod(step, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        share = self.global_batch // self.dp
        start = k * self.global_batch + self.dp_rank * share
        return order[start:start + share].tolist()

    def batch_size(self, step: int) -> int:
        """Global batch of `step`."""
        return self.sizes.size(step - self.phase["step"]) if self.sizes is not None else self.global_batch

    def position(self, step: int) -> int:
        """Where `step` starts reading, in the epochs' orders laid end to end."""
        if not self._streamed:
            epoch, k = divmod(step, self.batches_per_epoch)
            return epoch * len(self.dataset) + k * self.global_batch
        since = step - self.phase["step"]
        return self.phase["offset"] + (self.sizes.consumed(since) if self.sizes is not None
                                       else since * self.global_batch)

    def _stream_indices(self, step: int) -> list[int]:
        """A ramped batch (or one after a resume changed it): the samples after those
        every earlier step read, in the epochs' orders laid end to end (a batch may end
        one epoch and begin the next), so each sample is read once an epoch whatever
        the batch of each step."""
        share = self.batch_size(step) // self.dp
        first = self.position(step) + self.dp_rank * share
        n = len(self.dataset)
        out = []
        for p in range(first, first + share):
            epoch, i = divmod(p, n)
            out.append(int(self._epoch_order(epoch)[i]))
        return out

    def batch(self, step: int):
        samples = [self.dataset[i] for i in self.indices(step)]
        return collate(samples)

    def state_dict(self) -> dict:
        state = {"seed": self.seed, "samples": len(self.dataset), "global_batch": self.global_batch,
                 "shuffle": self.shuffle, "quantum": self._quantum}
        if self.sizes is not None:
            state["batch_ramp"] = self.sizes.to_dict()["ramp"]
        if self.phase["step"]:
            state["phase"] = dict(self.phase)
        return state

    def resume(self, state: dict, step: int) -> str | None:
        """Continue a snapshot's data order at `step`. The seed, data and shuffling must be
        the saved run's (else the order differs: refused). The same global batch (and
        ramp) reads what the uninterrupted run reads; another one (a batch grown on
        resume, as large runs do) continues from the sample the saved run would read at
        `step`, so each sample is still read once an epoch; its ramp, if any, starts
        there. -> the line saying so, or None when nothing changed."""
        mine = self.state_dict()
        diff = [f"{k} {state.get(k)} -> {mine[k]}" for k in ("seed", "samples", "shuffle") if state.get(k) != mine[k]]
        if diff:
            raise AutoparError(f"the snapshot was trained on another data order ({', '.join(diff)})",
                               hint="resume with the same --data and --seed, or start a new --save-dir")
        saved_phase = state.get("phase", {"step": 0, "offset": 0})
        ramp = mine.get("batch_ramp")
        if ((state.get("global_batch"), state.get("batch_ramp")) == (self.global_batch, ramp)
                and (not ramp or state.get("quantum", self._quantum) == self._quantum)):  # a ramp's sizes round to it
            self.phase = dict(saved_phase)
            return None
        old = _saved_reader(self.dataset, state, saved_phase)
        if old is None:
            raise AutoparError("the snapshot's global batch cannot be continued at another one: it was written by "
                               "an older autopar that did not record the ramp's micro-batch quantum",
                               hint="resume with its --batch-size and --batch-ramp")
        was, self.phase = old.batch_size(step), {"step": step, "offset": old.position(step)}
        return (f"the global batch changes at step {step}: {was} -> {self.batch_size(step)}; the data order "
                f"continues from the sample the saved run would read next (each still once an epoch)")


def _saved_reader(dataset, state: dict, phase: dict) -> GlobalBatches | None:
    """A reader laid out as the run that wrote `state` was (rank 0 of one), for its positions."""
    ramp = state.get("batch_ramp")
    if ramp and "quantum" not in state:
        return None
    start, steps = (int(x) for x in ramp.split(":")) if ramp else (None, 0)
    sizes = BatchSizes(state["global_batch"], state.get("quantum", state["global_batch"]), start, steps)
    reader = GlobalBatches(dataset, state["global_batch"], 1, 0, seed=state["seed"], shuffle=state["shuffle"],
                           sizes=sizes)
    reader.phase = dict(phase)
    return reader


def collate(samples: list):
    """[(inputs, target), ...] -> (tuple of stacked inputs, stacked targets)."""
    first_inputs = samples[0][0]
    if isinstance(first_inputs, torch.Tensor):
        inputs = (torch.stack([s[0] for s in samples]),)
    else:
        inputs = tuple(torch.stack([s[0][j] for s in samples]) for j in range(len(first_inputs)))
    targets = torch.stack([torch.as_tensor(s[1]) for s in samples])
    return inputs, targets


class Synthetic:
    """Random samples shaped as the model's example inputs (`--synthetic`): a smoke
    test of the layout, nothing to learn. Targets: the inputs shifted by one for a
    token model with the model file's own loss, the inputs themselves for a Hugging
    Face causal LM (which shifts its labels itself), or the example inputs' own
    labels when they carry some."""

    def __init__(self, example_inputs, seed: int = 0, shift: bool = True, split=None, size: int = 1 << 20):
        self.example_inputs, self.seed, self.shift, self.split, self.size = example_inputs, seed, shift, split, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        with torch.random.fork_rng(devices=[]):  # the training RNG (dropout) is not touched
            torch.manual_seed(self.seed * 1_000_003 + 1000 + i)
            return self._sample()

    def _sample(self):
        if self.split is not None:
            inputs, targets = self.split(1)
            if targets is not None:
                return tuple(x[0] for x in inputs), targets[0]
        else:
            inputs = self.example_inputs(1)
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        first = inputs[0][0]
        if first.dtype.is_floating_point:
            raise AutoparError("--synthetic makes token targets; this model's inputs are not token ids",
                               hint="define dataset() in the model file returning (inputs, targets) samples")
        target = torch.roll(first, shifts=-1, dims=0) if self.shift else first
        return tuple(x[0] for x in inputs), target


class StripeImages(Dataset):
    """A stand-in image classification set, made on the fly: class c is a grating at
    angle c x 180 / classes degrees, with a random phase, frequency jitter and pixel
    noise per sample (deterministic from seed and index). Learnable in a few hundred
    steps, so a vision model's training run shows a falling loss without a download;
    a model file's dataset() swaps in torchvision's ImageFolder for real images."""

    def __init__(self, image_size: int, classes: int = 10, size: int = 50_000, channels: int = 3, seed: int = 0,
                 noise: float = 0.5):
        self.image_size, self.classes, self.size = image_size, classes, size
        self.channels, self.seed, self.noise = channels, seed, noise
        coords = torch.arange(image_size, dtype=torch.float32) / image_size
        self._y, self._x = torch.meshgrid(coords, coords, indexing="ij")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(self.classes, (1,), generator=g))
        angle = torch.tensor(torch.pi * label / self.classes)
        freq = 4.0 + 2.0 * torch.rand((), generator=g)
        phase = 2 * torch.pi * torch.rand((), generator=g)
        wave = torch.sin(2 * torch.pi * freq * (self._x * torch.cos(angle) + self._y * torch.sin(angle)) + phase)
        image = wave.expand(self.channels, -1, -1) + self.noise * torch.randn(
            self.channels, self.image_size, self.image_size, generator=g)
        return image, torch.tensor(label)
