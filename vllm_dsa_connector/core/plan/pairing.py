"""Pairing D's newly allocated blocks with P's blocks of the same token positions (pure, no vLLM).

D's scheduler learns P's block ids for a request (``remote_block_ids``) and vLLM gives D new blocks for the
tokens its own prefix cache does not hold; :func:`pair_blocks_by_position` lines both lists up by token
position (P with ``Bp``-token blocks, D with ``Bd``) and returns the :class:`BlockPairing` that
:meth:`vllm_dsa_connector.core.plan.peer_plan.PeerPlan.runs` turns into byte runs. Whatever does not add up (another
prompt, too few ids, a hit that is not whole D blocks) is a :class:`PairingError`: a load failure, never a
guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PairingError(ValueError):
    """D's blocks cannot be paired with P's by token position; the message names both sides' numbers."""


@dataclass(frozen=True)
class BlockPairing:
    """Which of P's blocks go into which of D's, by token position.

    D loads tokens ``[first_token, first_token + num_tokens)``; ``src_blocks[i]`` holds P's tokens
    ``[(first_block + i) * Bp, +Bp)`` (``first_block = first_token // Bp``), ``dst_blocks[j]`` D's tokens
    ``[first_token + j * Bd, +Bd)``: exactly :meth:`PeerPlan.runs`' convention. D already holds the tokens
    before ``first_token`` (its own prefix-cache hits, whole D blocks). With one block size ``src_blocks[i]``
    and ``dst_blocks[i]`` hold the same tokens.
    """

    first_block: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    first_token: int = 0
    num_tokens: int = 0


def pair_blocks_by_position(*, prompt_tokens: int, local_computed_tokens: int, local_new_blocks: Sequence[int],
                            remote_block_ids: Sequence[int], remote_num_tokens: int, block_size: int | None = None,
                            src_block_size: int | None = None, dst_block_size: int | None = None) -> BlockPairing:
    """Pair D's newly allocated blocks with P's blocks of the same token positions.

    ``block_size`` means both sides use it; else P's blocks hold ``src_block_size`` tokens and D's
    ``dst_block_size``. ``local_computed_tokens`` are D's prefix-cache hits (whole D blocks),
    ``local_new_blocks`` the blocks vLLM allocated for the rest (position order), ``remote_block_ids`` every
    block of P's request (position order, P's own hits included) and ``remote_num_tokens`` the tokens P's KV
    holds. P must hold exactly the prompt D loads; anything else is a :class:`PairingError` (a load failure,
    never a guess).
    """
    bp = src_block_size if src_block_size is not None else block_size
    bd = dst_block_size if dst_block_size is not None else block_size
    if bp is None or bd is None:
        raise PairingError("give block_size, or src_block_size and dst_block_size")
    if bp <= 0 or bd <= 0:
        raise PairingError(f"block size must be positive, got {bp if bp <= 0 else bd}")
    if remote_num_tokens != prompt_tokens:
        raise PairingError(f"P holds KV of {remote_num_tokens} tokens, D's prompt has {prompt_tokens}: "
                           "not the same prompt")
    need_remote = -(-remote_num_tokens // bp)
    if len(remote_block_ids) < need_remote:
        raise PairingError(f"P sent {len(remote_block_ids)} block ids for {remote_num_tokens} tokens "
                           f"(block size {bp} needs {need_remote})")
    if local_computed_tokens < 0 or local_computed_tokens % bd:
        raise PairingError(f"D's prefix-cache hit of {local_computed_tokens} tokens is not whole "
                           f"{bd}-token blocks")
    if local_computed_tokens >= prompt_tokens:
        raise PairingError(f"D already holds {local_computed_tokens} of {prompt_tokens} tokens: nothing to load")
    first = local_computed_tokens // bp
    count = -(-prompt_tokens // bd) - local_computed_tokens // bd
    if len(local_new_blocks) < count:
        raise PairingError(f"D allocated {len(local_new_blocks)} blocks for tokens {local_computed_tokens}.."
                           f"{prompt_tokens} (needs {count})")
    if any(b < 0 for b in remote_block_ids[:need_remote]) or any(b < 0 for b in local_new_blocks[:count]):
        raise PairingError("negative block id")
    return BlockPairing(first, tuple(int(b) for b in remote_block_ids[first:need_remote]),
                        tuple(int(b) for b in local_new_blocks[:count]), local_computed_tokens,
                        prompt_tokens - local_computed_tokens)
