"""The vLLM column of `python -m pddgw.bench.engine`, run with vLLM's own python.

`VLLM_PYTHON pddgw/harness/vllm_side.py` (started by `harness.sides.VllmSide`, not by hand).
A plain script: it imports only the standard library and vLLM (never pddgw),
because it runs in vLLM's virtual environment (scripts/make_vllm_env.sh).

Protocol: one JSON object per line on stdin, one reply per line on the original stdout
(everything else the process prints is moved to stderr).
  1. -> {"model": DIR, "dtype": "float32", "max_model_len": M,
         "max_num_seqs": B, "max_num_batched_tokens": T, "enforce_eager": bool}
     <- {"ok": true, "vllm_version": ..., "torch_version": ...,
         "threads_bind": "nobind", "omp_threads": "1"}
        or {"ok": false, "error": "..."} (then exit 1)
  2. -> {"op": "run", "prompts": [[ids]], "output_len": N}
     <- {"ok": true, "to_first": s, "total": s, "tokens": [[ids]]}
     Timed as pddgw's side is: t0 before the requests are added, `to_first`
     when every request has its first token, `total` after the last step;
     greedy, N tokens each, EOS ignored.  Repeated as often as asked.
  3. -> {"op": "quit"} (or end of stdin) -> exit 0.

The parent sets OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND ("nobind", "0", "0-3") and
VLLM_ENABLE_V1_MULTIPROCESSING=0, so scheduler and model run in this one process.
"""

import json
import os
import sys
import time
import traceback

# This file's folder (pddgw/harness) comes first on sys.path when run as a script; its
# modules (engines.py, ...) would shadow packages vLLM imports.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]


def _reply_stream():
    """A private copy of stdout for replies; fd 1 then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _build(init):
    from vllm import LLM

    return LLM(model=init["model"], skip_tokenizer_init=True, dtype=init["dtype"],
               max_model_len=init["max_model_len"], max_num_seqs=init["max_num_seqs"],
               max_num_batched_tokens=init["max_num_batched_tokens"],
               enable_prefix_caching=False, enforce_eager=init.get("enforce_eager", False),
               seed=0)


def _run(llm, prompts, output_len):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len,
                            ignore_eos=True, detokenize=False)
    engine = llm.llm_engine
    out = {f"r{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(p)}, params)
    t_first = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = list(o.outputs[0].token_ids)   # cumulative
        if t_first is None and all(out.values()):
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    tokens = [out[f"r{i}"] for i in range(len(prompts))]
    if t_first is None or any(len(t) != output_len for t in tokens):
        raise RuntimeError(f"vLLM generated {sorted({len(t) for t in tokens})} tokens per request, "
                           f"expected {output_len}")
    return {"ok": True, "to_first": t_first - t0, "total": t_end - t0, "tokens": tokens}


def main():
    reply = _reply_stream()

    def send(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    line = sys.stdin.readline()
    if not line:
        return 0
    try:
        init = json.loads(line)
        llm = _build(init)
        import torch
        import vllm

        send({"ok": True, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
              "omp_threads": os.environ.get("OMP_NUM_THREADS", "")})
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which says why
        traceback.print_exc()
        send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "quit":
            break
        try:
            send(_run(llm, msg["prompts"], msg["output_len"]))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            send({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
