"""
The packed upload: every device input of a step goes up in one host->device copy.

InputBuffers owns one byte buffer on the device and its host twin (pinned on a GPU; on a CPU the
twin is the buffer itself). Its head holds the regions a captured graph reads, each at a fixed
address and sized once at its largest (input ids, positions, slots, logits rows, context lengths,
query offsets, the CUDA plan, and each row's slot in the persistent block table); its tail is
filled per step by whoever has inputs for it (stage_extra: the changed block-table rows, the
sampler's per-row numbers, grammar bitmasks, new requests' sampling parameters). flush() copies
the staged bytes, non_blocking, in one copy.

The block tables stay on the device between steps (BlockTableRows): each sequence keeps a row of a
persistent table, and a step uploads only the rows whose contents changed (a row index and the
row), then gathers its rows into the [rows, width] table the kernels read. Owns no scheduling,
block choice or sampling: model_runner.py and sampling_slots.py say what to stage.
"""
import math
import sys

import numpy as np
import torch

ALIGN = 16                  # bytes: every view starts on a 16-byte boundary


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device, extra_bytes: int = 0):
        """extra_bytes: the tail's size, for what other parts stage per step (sampling_slots.py)."""
        i32, i64 = torch.int32, torch.int64
        shapes = dict(input_ids=((max_tokens,), i64), positions=((max_tokens,), i64),
                      slot_mapping=((max_tokens,), i64), logits_rows=((max_tokens,), i64),
                      context_lens=((max_seqs,), i32), query_start_loc=((max_seqs + 1,), i32),
                      plan=((2 + 2 * max_tokens,), i32), table_slots=((max_seqs,), i64))
        self.device, self.max_tokens, self.max_seqs, self.width = device, max_tokens, max_seqs, width
        self.offsets, total = {}, 0
        for name, (shape, dt) in shapes.items():
            self.offsets[name] = total
            total += aligned(math.prod(shape) * dt.itemsize)
        self.tail = total                                                  # where stage_extra starts
        # the tail holds a step's changed table rows (each row's index and contents) besides the extras
        total += aligned(max_seqs * 8) + aligned(max_seqs * width * 4) + aligned(extra_bytes)
        self.dev_bytes = torch.zeros(total, dtype=torch.uint8, device=device)   # [total]
        self.host_bytes = self.dev_bytes if device.type == "cpu" else \
            torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        def views(buf):
            return {k: buf[self.offsets[k]:self.offsets[k] + math.prod(shape) * dt.itemsize].view(dt).view(shape)
                    for k, (shape, dt) in shapes.items()}
        self.dev, self.host = views(self.dev_bytes), views(self.host_bytes)
        # what the kernels read (a graph at this address), gathered each step from the persistent rows
        self.block_tables = torch.zeros((max_seqs, width), dtype=torch.int32, device=device)   # [max_seqs, width]
        self.table = BlockTableRows(2 * max_seqs + 1, width, device)
        self.end = 0                        # bytes staged this step
        self.cursor = self.tail             # the tail's next free byte
        self.spilled = []                   # (host, device) tensors past the tail: copied on their own
        self.uploaded = None                # CUDA event after the last step's copy
        self.warned_spill = False

    def fits(self, num_tokens: int, num_seqs: int, width: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and width <= self.width

    def fits_host(self, host) -> bool:
        return self.fits(len(host.input_ids), len(host.context_lens), host.block_tables.shape[1])

    def reuse_staging(self):
        """Before a step writes the pinned twin: wait for the copy that last read it (under async
        scheduling the host is a step ahead of the device)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """values into the leading slice of region `name`'s host twin; returns the device slice they go to."""
        values = values.reshape(-1)
        self.host[name].view(-1)[:len(values)].copy_(torch.from_numpy(values))
        self.end = max(self.end, self.offsets[name] + values.nbytes)
        return self.dev[name].view(-1)[:len(values)]

    def reserve(self, shape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) views of the next free bytes of the tail, for the caller to fill on the host
        (llguidance writes bitmasks straight into it). A step whose extras pass the tail gets a
        one-off pair, copied at flush on its own (said once, with the sizes)."""
        nbytes = math.prod(shape) * dtype.itemsize
        at = self.cursor
        if at + nbytes > self.dev_bytes.numel():
            if not self.warned_spill:
                self.warned_spill = True
                print(f"nanoserve: a step's inputs passed the packed upload's {self.dev_bytes.numel()} bytes: "
                      f"{nbytes} bytes go up in a copy of their own", file=sys.stderr, flush=True)
            pin = self.device.type == "cuda"
            pair = (torch.empty(shape, dtype=dtype, pin_memory=pin), torch.empty(shape, dtype=dtype, device=self.device))
            if self.device.type == "cpu":
                pair = (pair[0], pair[0])
            self.spilled.append(pair)
            return pair
        self.cursor = at + aligned(nbytes)
        self.end = max(self.end, at + nbytes)
        return tuple(buf[at:at + nbytes].view(dtype).view(shape) for buf in (self.host_bytes, self.dev_bytes))

    def stage_extra(self, values) -> torch.Tensor:
        """A host array (numpy or torch) into the tail; returns its device view."""
        values = torch.as_tensor(values)
        host, dev = self.reserve(tuple(values.shape), values.dtype)
        host.copy_(values)
        return dev

    def stage_tables(self, keys: list, own: list, tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tables: [rows, w] int32; keys: each row's owner (None: a padding row, all zeros); own: each
        row's block ids as its owner holds them (what is compared). Stages the rows' slots and the rows
        that changed; -> (slots, changed slots, changed rows [changed, w]) device views."""
        slots, changed = self.table.assign(keys, own)
        dev_slots = self.stage("table_slots", np.asarray(slots, dtype=np.int64))
        return dev_slots, self.stage_extra(np.asarray([slots[i] for i in changed], dtype=np.int64)), \
            self.stage_extra(np.ascontiguousarray(tables[changed]))

    def flush(self):
        """The step's one copy: every staged byte, non_blocking from the pinned twin on a GPU."""
        if self.host_bytes is not self.dev_bytes:
            self.dev_bytes[:self.end].copy_(self.host_bytes[:self.end], non_blocking=True)
            for host, dev in self.spilled:
                dev.copy_(host, non_blocking=True)
            if self.device.type == "cuda":
                self.uploaded = torch.cuda.Event()
                self.uploaded.record()
        self.end, self.cursor, self.spilled = 0, self.tail, []

    def gather_tables(self, slots: torch.Tensor, changed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """On the device, after flush: write the changed rows into the persistent table, then gather
        the step's rows. -> the [num_rows, width] table the kernels read."""
        w = rows.shape[1] if rows.dim() == 2 else 0
        if len(changed):
            self.table.rows[:, :w].index_copy_(0, changed, rows)           # [num_slots, w] <- [changed, w]
        out = self.block_tables[:len(slots)]
        torch.index_select(self.table.rows, 0, slots, out=out)             # [num_rows, width]
        return out


class BlockTableRows:
    """The persistent block table on the device: a row per sequence, slot 0 kept all zeros for
    padding rows. The host keeps what each row holds, so a step sends only the rows that changed
    (a decode step: the rows that crossed into a new block). A key is only a cache: contents are
    compared, so a recycled key or slot can never leave a stale row."""
    def __init__(self, num_slots: int, width: int, device: torch.device):
        self.rows = torch.zeros((num_slots, width), dtype=torch.int32, device=device)   # [num_slots, width]
        self.slot_of: dict = {}
        self.held: list = [None] * num_slots          # per slot: the row it holds on the device, as a list
        self.free = list(range(num_slots - 1, 0, -1))

    def assign(self, keys: list, own: list) -> tuple[list[int], list[int]]:
        """-> (each row's slot, the rows whose contents must go up). A changed row is written at the
        step's width, zero-padded; nothing reads a row past its context."""
        slots, changed = [], []
        for i, (key, blocks) in enumerate(zip(keys, own)):
            if key is None:
                slots.append(0)
                continue
            slot = self.slot_of.get(key)
            if slot is None:
                if not self.free:                     # evict the sequences this step does not run
                    step_keys = set(keys)
                    for k in [k for k in self.slot_of if k not in step_keys]:
                        self.free.append(self.slot_of.pop(k))
                slot = self.slot_of[key] = self.free.pop()
            if self.held[slot] != blocks:             # list compare: a decode row changes once a block
                self.held[slot] = list(blocks)
                changed.append(i)
            slots.append(slot)
        return slots, changed


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
