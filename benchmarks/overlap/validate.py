"""The overlap validation: measure at W = 2 on CPU (:mod:`benchmarks.overlap.measure`), predict every
measured step with the null model, the simulator and the simulator with host contention, and score
each prediction against the measured step (see the package docstring, 1)."""

from __future__ import annotations

import math
import os
import statistics
import time

from flashfsdp import sim
from flashfsdp.sim import calibrate
from flashfsdp_dev.ranks import run_ranks

from .measure import DEFAULT, SCHEDULES, Config, measure_rank

TARGET_PCT = 20.0  # the goal: predicted W = 2 step within 20% of the measured one
PREDICTORS = (("sim", "sim", "null"), ("sim+host", "host", "null"), ("sim, traced", "traced_sim", "traced_null"))
VERDICT_COLUMNS = ["config", "predictor", "step_within_target", "worst_step_err_pct", "closer_than_null",
                   "worst_noncompute_err_pct", "worst_exposed_err_pct"]


def _predict(model: sim.Model, link: sim.Link, schedule: str, copy_bandwidth, contention=None) -> sim.Prediction:
    """One rank's step (``simulate``) with W = 2 gloo semantics under ``schedule``."""
    return sim.simulate(model, 2, link, shared_comm_stream=True, host_blocking=True, copy_bandwidth=copy_bandwidth,
                        contention=contention, record_timeline=True, steps=3,
                        **SCHEDULES[schedule].simulate_kwargs(model))


def _predict_ranks(models: list[sim.Model], link: sim.Link, schedule: str, copies: list,
                   contention=None) -> list[sim.Prediction]:
    """Both ranks' steps, coupled through their collectives (``simulate_ranks``), W = 2 gloo semantics."""
    return sim.simulate_ranks(models, 2, link, shared_comm_stream=True, host_blocking=True, copy_bandwidth=copies,
                              contention=contention, record_timeline=True, steps=3,
                              **SCHEDULES[schedule].simulate_kwargs(models[0]))


def _err(predicted: float, measured: float) -> float:
    return (predicted / measured - 1) * 100 if measured > 0 else math.nan


def _twin_rounds(config: Config, measured: list[dict]) -> list[tuple[list[sim.Model], list]]:
    """Per round, each rank's model and copy bandwidth from its comm-free twin of that round."""
    meta = measured[0]["units"]
    per_round = []
    for i in range(min(len(m["twin"]["rounds"]) for m in measured)):
        models = [calibrate.model_from_inputs(meta, m["twin"]["rounds"][i], m["twin"]["optimizer_rounds"][i],
                                              f"{config.name} rank {r}") for r, m in enumerate(measured)]
        copies = [calibrate.copy_bandwidth(m["twin"]["rounds"][i]) for m in measured]
        per_round.append((models, copies))
    return per_round


def _comm_free_predictions(config: Config, measured: list[dict], link: sim.Link, contention) -> dict:
    """Per schedule, the null, sim and sim+host predictions from the comm-free inputs: per round,
    each rank's own inputs of that round (the twins ran at the same time on both ranks), the ranks
    coupled by their collectives; the median over rounds. Times in ms."""
    per_round = _twin_rounds(config, measured)
    mean = statistics.fmean
    out = {}
    for schedule in SCHEDULES:
        samples = {k: [] for k in ("null", "sim", "sim_exposed", "host", "host_exposed", "host_busy", "uncoupled",
                                   "uncoupled_exposed")}
        timeline = None
        for models, copies in per_round:
            samples["null"].append(max(m.compute_s() for m in models) * 1e3)
            preds = _predict_ranks(models, link, schedule, copies)
            samples["sim"].append(mean(p.step_s for p in preds) * 1e3)
            samples["sim_exposed"].append(mean(p.exposed_s for p in preds) * 1e3)
            timeline = preds[0].timeline
            if contention is not None:
                host = _predict_ranks(models, link, schedule, copies, contention)
                samples["host"].append(mean(p.step_s for p in host) * 1e3)
                samples["host_exposed"].append(mean(p.exposed_s for p in host) * 1e3)
                samples["host_busy"].append(mean(p.comm_busy_s for p in host) * 1e3)
                alone = [_predict(m, link, schedule, c, contention) for m, c in zip(models, copies)]
                samples["uncoupled"].append(mean(p.step_s for p in alone) * 1e3)
                samples["uncoupled_exposed"].append(mean(p.exposed_s for p in alone) * 1e3)
                timeline = host[0].timeline
        out[schedule] = {k: statistics.median(v) if v else math.nan for k, v in samples.items()}
        out[schedule]["timeline"] = timeline
        out[schedule]["comm_alone"] = preds[0].comm_s * 1e3
        out[schedule]["sim_busy"] = preds[0].comm_busy_s * 1e3
    return out


def _link_columns(link: sim.Link, contention) -> dict:
    """The fitted link and contention, as every row of the configuration carries them."""
    return {"alpha_us": link.alpha_s * 1e6, "beta_GBps": link.bandwidth / 1e9,
            "rs_alpha_us": link.rs_alpha_s * 1e6, "rs_beta_GBps": link.rs_bandwidth / 1e9,
            "compute_rate": contention.compute_rate if contention else math.nan,
            "comm_rate": contention.comm_rate if contention else math.nan,
            "rs_compute_rate": contention.rates("reduce_scatter")[0] if contention else math.nan,
            "rs_comm_rate": contention.rates("reduce_scatter")[1] if contention else math.nan}


def _scores(step: float, exposed: float, compute: float, f: dict, traced_compute: float,
            traced_p: sim.Prediction) -> dict:
    """Each predictor's step, non-compute time and exposed communication next to the measured ones."""
    sim_ms, host_ms, traced_ms = f["sim"], f["host"], traced_p.step_s * 1e3
    return {
        # step time: null model vs simulator
        "null_ms": compute, "null_err_pct": _err(compute, step),
        "sim_ms": sim_ms, "sim_err_pct": _err(sim_ms, step),
        "host_ms": host_ms, "host_err_pct": _err(host_ms, step),
        "traced_null_ms": traced_compute, "traced_null_err_pct": _err(traced_compute, step),
        "traced_sim_ms": traced_ms, "traced_sim_err_pct": _err(traced_ms, step),
        # what the simulator predicts: step - compute, and exposed communication
        "measured_noncompute_ms": step - compute,
        "sim_noncompute_ms": sim_ms - compute, "sim_noncompute_err_pct": _err(sim_ms - compute, step - compute),
        "host_noncompute_ms": host_ms - compute, "host_noncompute_err_pct": _err(host_ms - compute, step - compute),
        "traced_measured_noncompute_ms": step - traced_compute,
        "traced_sim_noncompute_ms": traced_ms - traced_compute,
        "traced_sim_noncompute_err_pct": _err(traced_ms - traced_compute, step - traced_compute),
        "measured_exposed_ms": exposed,
        "sim_exposed_ms": f["sim_exposed"], "sim_exposed_err_pct": _err(f["sim_exposed"], exposed),
        "host_exposed_ms": f["host_exposed"], "host_exposed_err_pct": _err(f["host_exposed"], exposed),
        "traced_sim_exposed_ms": traced_p.exposed_s * 1e3,
        "traced_sim_exposed_err_pct": _err(traced_p.exposed_s * 1e3, exposed),
    }


def _rows_of_config(config: Config, measured: list[dict], link: sim.Link, contention, env) -> tuple[list[dict], dict]:
    """Rows (one per schedule) and timelines of one configuration; ``measured`` is per rank."""
    rank0 = measured[0]
    free = _comm_free_predictions(config, measured, link, contention)
    default = rank0["schedules"][DEFAULT]
    traced_model = calibrate.model_from_inputs(rank0["units"], default["inputs"], default["outside_ms"],
                                               f"{config.name} (traced)")
    traced_copy = calibrate.copy_bandwidth(default["inputs"])
    traced_compute = traced_model.compute_s() * 1e3
    rows = []
    for schedule in SCHEDULES:
        per_rank = [m["schedules"][schedule] for m in measured]
        step = statistics.median([r["step_ms"] for r in per_rank])
        f = free[schedule]
        rows.append({
            "config": config.name, "schedule": schedule, "world_size": 2, "params_M": rank0["params"] / 1e6,
            "measured_step_ms": step, "rank_step_ms": " / ".join(f"{r['step_ms']:.1f}" for r in per_rank),
            "comm_share_pct": f["comm_alone"] / step * 100,
            **_scores(step, statistics.median([r["inputs"]["exposed_ms"] for r in per_rank]), f["null"], f,
                      traced_compute, _predict(traced_model, link, schedule, traced_copy)),
            "host_uncoupled_ms": f["uncoupled"], "host_uncoupled_exposed_ms": f["uncoupled_exposed"],
            "measured_comm_busy_ms": statistics.median([r["inputs"]["comm_busy_ms"] for r in per_rank]),
            "sim_comm_busy_ms": f["sim_busy"], "host_comm_busy_ms": f["host_busy"], "comm_alone_ms": f["comm_alone"],
            "measured_traced_step_ms": per_rank[0]["traced_step_ms"],
            "copy_in_GBps": (calibrate.copy_bandwidth(rank0["twin"]["inputs"]) or math.nan) / 1e9,
            **_link_columns(link, contention), **env.stamp(),
        })
    spans = default["spans"]
    t0 = min(x.start for x in spans)
    label = "sim+host" if contention is not None else "sim"
    timelines = {f"{config.name}: measured (rank 0, traced), {DEFAULT}": [
                     sim.Span(x.stream, x.kind, x.unit, x.start - t0, x.end - t0) for x in spans],
                 f"{config.name}: predicted ({label}, rank 0, last round), {DEFAULT}": free[DEFAULT]["timeline"]}
    return rows, timelines


def verdicts(rows: list[dict]) -> list[dict]:
    """Per configuration and predictor: in how many schedules the step is within :data:`TARGET_PCT`,
    the worst errors (step, non-compute, exposed), and in how many the predictor beats its null model."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        for label, key, null in PREDICTORS:
            errs = [r[f"{key}_err_pct"] for r in mine]
            if any(math.isnan(e) for e in errs):
                continue
            worst = lambda values: max(values, key=lambda v: abs(v) if not math.isnan(v) else -1.0)  # noqa: E731
            out.append({
                "config": config, "predictor": label,
                "step_within_target": f"{sum(abs(e) <= TARGET_PCT for e in errs)}/{len(mine)}",
                "worst_step_err_pct": worst(errs),
                "closer_than_null": f"{sum(abs(r[f'{key}_err_pct']) < abs(r[f'{null}_err_pct']) for r in mine)}/{len(mine)}",
                "worst_noncompute_err_pct": worst([r[f"{key}_noncompute_err_pct"] for r in mine]),
                "worst_exposed_err_pct": worst([r[f"{key}_exposed_err_pct"] for r in mine]),
            })
    return out


def _print_link(link: sim.Link, cal: dict) -> None:
    print(f"link: {link.describe()}")
    for kind in calibrate.COLLECTIVES:
        fit = link.all_gather_s if kind == "all_gather" else link.reduce_scatter_s
        print("  " + kind + ": " + ", ".join(f"{n / 2**20:.2g} MiB {t * 1e3:.2f} ms (fit {fit(n, w) * 1e3:.2f})"
                                             for n, w, t in cal[kind]))


def validate(args, env, configs: list[Config]) -> tuple[list[dict], dict]:
    """Calibrate, measure and simulate at W = 2 on CPU; returns rows and extras (timelines, link, ...)."""
    # 64 KiB .. 16 MiB (quick: 1, 4, 16 MiB: with one round, smaller ones are all latency and noise)
    sizes = [2**k for k in (range(20, 25, 2) if args.quick else range(16, 25, 2))]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    measured = run_ranks(measure_rank, 2, args, configs, sizes, backend="gloo")
    seconds = time.perf_counter() - t0
    cal = measured[0]["calibration"]
    link = sim.fit_link("gloo W=2 (fitted)", cal["all_gather"], cal["reduce_scatter"])
    _print_link(link, cal)
    rows, timelines, contentions = [], {}, {}
    for config in configs:
        per_rank = [m["configs"][config.name] for m in measured]
        contention = calibrate.fit_probe_contention([p["contention"] for p in per_rank], name="gloo W=2 host")
        kept = {k: sum(len(p["contention"][k]) for p in per_rank) for k in calibrate.COLLECTIVES}
        dropped = {k: sum(p["contention_dropped"][k] for p in per_rank) for k in calibrate.COLLECTIVES}
        contentions[config.name] = (contention, kept, dropped)
        print(f"{config.name}: contention " + (contention.describe() if contention else "not measurable"))
        config_rows, config_timelines = _rows_of_config(config, per_rank, link, contention, env)
        rows += config_rows
        timelines.update(config_timelines)
    load = (load_before, os.getloadavg()[0])
    for row in rows:
        row["load_avg"] = f"{load[0]:.1f} -> {load[1]:.1f}"
    return rows, {"timelines": timelines, "link": link, "calibration": cal, "load": load,
                  "contentions": contentions, "seconds": seconds}
