"""One request's state inside an engine.

Lifecycle (SeqStatus, ordered):
  1. WAITING    queued without blocks ("compute" requests, and preempted ones,
                which recompute from their tokens).
  2. IMPORTING  "import" requests: every prompt block allocated at add time,
                KV arriving through import_kv until finish_import.
  3. READY      imported: holds its KV, waits for a place in the running batch
                (max_num_seqs bounds the batch, imported requests included,
                as vLLM's scheduler does for KV received through a connector).
  4. RUNNING    holds blocks; each step computes some of its pending tokens
                (prefill chunk, extend or decode) and, once all are computed
                and it is not on hold, samples the next token.
  5. RETAINED   finished, blocks kept for export until release (P nodes).
  6. FINISHED   blocks released; only the final RequestOutput remains.
"""

from __future__ import annotations

from enum import IntEnum

from pddgw.engines.block_manager import ROOT_HASH, chain_hashes
from pddgw.core.sampling import SamplingParams
from pddgw.engines.penalties import TokenCounts
from pddgw.engines.types import EngineRequest, FinishReason, KVSource


class SeqStatus(IntEnum):
    WAITING = 1
    IMPORTING = 2
    READY = 3
    RUNNING = 4
    RETAINED = 5
    FINISHED = 6


class Sequence:
    __slots__ = ("request_id", "sampling", "tokens", "num_prompt", "block_ids", "num_computed",
                 "num_cached_tokens", "kv_source", "hold", "retain", "status", "finish_reason",
                 "_hashes", "num_published", "imported", "last_reported", "leases", "constraint",
                 "out_every", "out_mark", "out_logprobs", "stops", "out_limit", "counts")

    def __init__(self, req: EngineRequest):
        self.request_id = req.request_id
        self.sampling: SamplingParams = req.sampling
        self.tokens: list[int] = [*req.prompt_token_ids, *req.output_token_ids]
        self.num_prompt = len(req.prompt_token_ids)
        self.block_ids: list[int] = []
        self.num_computed = 0          # tokens whose KV is in block_ids
        self.num_cached_tokens = 0     # of those, how many came from the prefix cache at admission
        self.kv_source: KVSource = req.kv_source
        self.hold = req.hold
        self.retain = req.retain_kv
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self._hashes: list[int] = []   # chained hashes of full blocks, grown lazily
        self.num_published = 0         # leading blocks published to the prefix cache
        self.imported: bytearray | None = None   # per prompt token: arrived via import_kv
        self.last_reported = 0         # num_computed last reported in a RequestOutput
        self.leases: dict = {}         # IMPORTING: block index -> pool lease (PagedEngine.import_buffer)
        # The grammar's matcher (engines/grammar.py), fed the output tokens lazily before each draw.
        self.constraint = None
        # Sampled tokens go out `out_every` at a time (EngineRequest.output_interval): num_outputs
        # when the last of them went out (-1: none sampled yet), and the held ones' logprobs.
        self.out_every = req.output_interval
        self.out_mark = -1
        self.out_logprobs: list = []
        # Set by the engine (`PagedEngine.add_request`): the tokens that may stop it and the most
        # outputs it may have, so that a step rules out a finish without `finish_reason`.
        self.stops: frozenset[int] = frozenset()
        self.out_limit = 0
        # The penalties' counts of its tokens (prompt counted once, here), brought up to date by the
        # sampler before each draw; None without penalties.
        self.counts = TokenCounts(self.tokens, self.num_prompt) if req.sampling.penalized else None

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_pending(self) -> int:
        """Tokens the next steps may compute.

        On hold the last token stays pending: computing it is what yields the
        logits to sample from once the hold is lifted.
        """
        return len(self.tokens) - self.num_computed - (1 if self.hold else 0)

    def seed_hashes(self, hashes: list[int]) -> None:
        """Start the hash list from already known chained hashes of the prompt's first full blocks
        (computed for the same tokens and block size elsewhere in this process)."""
        self._hashes = hashes

    def block_hashes(self, num_blocks: int, block_size: int, start: int = 0) -> list[int]:
        """Chained hashes of full blocks [start, num_blocks) of self.tokens (a copy of just
        those: a 64K-token request's publish of one block copied a thousand)."""
        have = len(self._hashes)
        if have < num_blocks:
            parent = self._hashes[-1] if self._hashes else ROOT_HASH
            # Only the new blocks' tokens are copied (a 64K prompt's list is sliced per call).
            self._hashes += chain_hashes(self.tokens[have * block_size : num_blocks * block_size], block_size,
                                         parent)
        return self._hashes[start:num_blocks]
