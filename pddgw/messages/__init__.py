"""The node messages: everything that crosses a node link, grouped by direction.

    link           the connection's own: Hello, Challenge, Auth, Welcome, Ping, Pong, Ack, Error
    to_node        router -> worker: PrefixQuery, Submit, Prefill, Demote, HandOff, StateQuery,
                   PromptLogprobsQuery, Cancel
    to_router      worker -> router: PrefixAnswer, Opened, PrefillDone, Ready, HandedOff,
                   HandoffRound, TokenItem, TokenBatch, NodeState, LoadReport, Draining
    between_nodes  worker -> worker: KVChunk (pddgw.core.kv), KvDone, Extend, TokenIds
    logprobs       Logprobs pieces, riding right before the message that carries their tokens

Every message is a frozen, slotted dataclass with a `tag` Literal, validated in
`__post_init__`: a message that exists is well formed.  `KINDS` is the one table
of wire kinds (append only: the numbers are protocol); `PACKED` names the field
each kind carries as its frame payload (net/frames.py).  Who sends what, and
when: docs/protocol.md.
"""

from pddgw.core.kv import Buffer, KVChunk, KVSpan
from pddgw.messages.between_nodes import Extend, KvDone, TokenIds
from pddgw.messages.fields import MAX_BATCH_ITEMS, MAX_HASHES, MAX_ID_CHARS, MAX_TARGETS, MAX_TEXT_CHARS, MAX_TOKEN_IDS
from pddgw.messages.link import Ack, Auth, Challenge, Error, Hello, Ping, Pong, Welcome
from pddgw.messages.logprobs import MAX_LOGPROB_POSITIONS, Logprobs, logprob_pieces
from pddgw.messages.to_node import (Cancel, Demote, HandOff, Prefill, PrefixQuery, PromptLogprobsQuery,
                                    StateQuery, Submit)
from pddgw.messages.to_router import (Draining, HandedOff, HandoffRound, LoadReport, NodeState, Opened,
                                      PrefillDone, PrefixAnswer, Ready, TokenBatch, TokenItem)

__all__ = [
    "MAX_BATCH_ITEMS", "MAX_HASHES", "MAX_ID_CHARS", "MAX_LOGPROB_POSITIONS", "MAX_TARGETS", "MAX_TEXT_CHARS",
    "MAX_TOKEN_IDS", "Ack", "Auth", "Buffer", "Cancel", "Challenge", "Demote", "Draining", "Error", "Extend",
    "HandOff", "HandedOff", "HandoffRound", "Hello", "KVChunk", "KVSpan", "KvDone", "LoadReport", "Logprobs",
    "Message", "NodeState", "Opened", "Ping", "Pong", "Prefill", "PrefillDone", "PrefixAnswer", "PrefixQuery",
    "PromptLogprobsQuery", "Ready", "StateQuery", "Submit", "TokenBatch", "TokenIds", "TokenItem", "Welcome",
    "logprob_pieces",
]

Message = (Hello | Challenge | Auth | Welcome | KVChunk | TokenIds | TokenItem | TokenBatch | Ready | Ack
           | Cancel | Error | LoadReport | PrefixQuery | PrefixAnswer | Ping | Pong
           | Submit | Opened | Prefill | PrefillDone | HandOff | HandedOff | HandoffRound | Extend
           | StateQuery | NodeState | KvDone | Demote | Logprobs | PromptLogprobsQuery | Draining)

# Wire kind of each message class.  Append only: the numbers are protocol.
KINDS: dict[int, type] = {
    1: Hello, 2: Challenge, 3: Auth, 4: Welcome,
    10: KVChunk, 11: TokenIds, 12: TokenItem, 13: TokenBatch,
    20: Ready, 21: Ack, 22: Cancel, 23: Error,
    30: LoadReport, 31: PrefixQuery, 32: PrefixAnswer,
    40: Ping, 41: Pong,
    100: Submit, 101: Opened, 102: Prefill, 103: PrefillDone, 104: HandOff, 105: HandedOff,
    106: HandoffRound, 107: Extend, 108: StateQuery, 109: NodeState, 110: KvDone, 111: Demote,
    112: Logprobs, 113: PromptLogprobsQuery,
    130: Draining,
}
KIND_OF: dict[type, int] = {cls: kind for kind, cls in KINDS.items()}
KV_KIND = 10
HANDSHAKE_KINDS: frozenset[int] = frozenset({1, 2, 3, 4})

# Field carried as the frame's payload, as an array of this type code: int32 token ids,
# uint64 prefix hashes.  KVChunk (raw bytes) and TokenBatch (its items' ids) are framed apart.
PACKED: dict[type, tuple[str, str]] = {
    TokenIds: ("i", "ids"), TokenItem: ("i", "ids"), PrefixQuery: ("Q", "hashes"),
    Submit: ("i", "prompt"), Prefill: ("i", "prompt"), Extend: ("i", "ids"), Logprobs: ("i", "top_ids"),
}


def ends_stream(msg: Message) -> bool:
    """True for the message that ends a `Link.stream` (after being yielded)."""
    if isinstance(msg, TokenItem):
        return msg.done
    if isinstance(msg, KVChunk):
        return msg.last
    return isinstance(msg, Cancel)
