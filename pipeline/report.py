"""What parastream prints: tables for builds, inspections and verifications."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from parastream.launcher.errors import ParastreamError
from parastream.launcher.words import plural


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def schedule_table(plan, title: str = "branches") -> Table:
    t = Table(title=title)
    for col in ("branch", "stream", "nodes", "first … last", "waits on", "bound", "est."):
        t.add_column(col, overflow="fold")
    for bid in plan.launch_order:
        b = plan.branches[bid]
        span = b.nodes[0] if len(b.nodes) == 1 else f"{b.nodes[0]} … {b.nodes[-1]}"
        waits = ", ".join(plan.branches[w].name for w in b.waits) or "-"
        t.add_row(b.name, str(b.stream), str(len(b.nodes)), span, waits, b.bound, _us(b.est_time))
    return t


def print_verification(result, console, title: str = "verification against onnxruntime") -> None:
    from rich.markup import escape

    console.print(verification_table(result.to_dict(), title=title))
    verdict = {"passed": "[green]PASSED[/green]", "failed": "[red]FAILED[/red]",
               "inconclusive": "[yellow]INCONCLUSIVE[/yellow]"}[result.status]
    console.print(f"{verdict} ({result.describe_criterion()}, {result.iterations} seeded random inputs)")
    for name, d in result.outputs.items():
        if d.get("not_meaningful"):
            console.print(f"[yellow]warning[/yellow]: output {escape(repr(name))} cannot judge the build: {escape(d['not_meaningful'])}")


def verification_table(ver: dict, title: str) -> Table:
    """Per-output errors of a Verification.to_dict(); reports written before scaled errors existed lack that column."""
    scaled = ver.get("criterion") is not None
    t = Table(title=title)
    cols = ["output", "max abs error", "max rel error"] + (["max scaled error", "elementwise ok"] if scaled else [])
    for col in cols + ["passed" if scaled else "within tolerance"]:
        t.add_column(col)
    for name, d in ver["outputs"].items():
        row = [name, f"{d['max_abs']:.3g}", f"{d['max_rel']:.3g}"]
        if scaled:
            row += [f"{d['max_scaled']:.3g}", "yes" if d["elementwise_passed"] else "no"]
        ok = "yes" if d["passed"] else "[red]NO[/red]"
        if d.get("not_meaningful"):
            ok += " [yellow](not meaningful)[/yellow]"
        t.add_row(*row, ok)
    return t


def _search_text(search: dict) -> str:
    """What the rewrite search proposed, in words (the search's own summary, its counts agreeing in number)."""
    if not search.get("enabled"):
        return "skipped" + (f": {search['skipped']}" if search.get("skipped") else "")
    try:
        before, after = search["cost_before"]["mixed_s"], search["cost_after"]["mixed_s"]
        if search.get("decided_by") == "unchanged":
            return search["summary"]
        gain = (1 - after / before) * 100 if before else 0.0
        how = "measured on the device" if search.get("decided_by") == "measured" else "decided by the cost model"
        return (f"{search['nodes_before']} → {search['nodes_after']} nodes, estimated {before * 1e6:.1f} → "
                f"{after * 1e6:.1f} µs ({gain:.0f}% less), {plural(len(search.get('rules_chosen', [])), 'rewrite')} in "
                f"{plural(len(search.get('pieces', [])), 'piece')}, {how}")
    except (KeyError, TypeError):  # a report of another version: its own words
        return str(search.get("summary", "done"))


def shipped_rewrites(rep: dict) -> tuple[int | None, int | None]:
    """(rewrites the bundle's model.onnx holds, rewrites the search proposed); None, None without a search.

    They differ where a CPU build timed the search's model against the original and kept the original
    (report.json ``model.rewritten``; a report without it: the CPU choice's name says which model it kept)."""
    search = rep.get("search", {})
    if not search.get("enabled"):
        return None, None
    proposed = len(search.get("rules_chosen", []))
    rewritten = rep.get("model", {}).get("rewritten")
    if rewritten is None:
        rewritten = not str((rep.get("cpu_choice") or {}).get("chosen", "")).startswith("original model")
    return (proposed if rewritten else 0), proposed


def build_summary(bundle) -> dict:
    """What a build step needs to know about a bundle, as one JSON-able dict (``parastream build --json``): the
    bundle as shipped (``rewrites``: those its model.onnx holds; ``rewrites_proposed`` and ``search``: what the
    search proposed, which a CPU build may have timed and not shipped)."""
    plan, rep = bundle.plan, bundle.report
    m, search, ver = rep.get("model", {}), rep.get("search", {}), rep.get("verification") or {}
    outputs = ver.get("outputs", {})
    shipped, proposed = shipped_rewrites(rep)
    return {
        "bundle": str(bundle.path), "backend": plan.backend, "precision": plan.precision,
        "streams": plan.num_streams, "engines": len(plan.branches), "cpu_threads": plan.cpu_threads,
        "nodes_in": m.get("nodes_in"), "nodes_out": m.get("nodes_out"),
        "rewrites": shipped, "rewrites_proposed": proposed,
        "search": _search_text(search),
        "cpu_choice": (rep.get("cpu_choice") or {}).get("chosen"),
        "verification": ({"status": ver.get("status", "passed" if ver.get("passed") else "failed"), "criterion": ver.get("criterion"),
                          "scale_tol": ver.get("scale_tol"),
                          "max_scaled_error": max((o.get("max_scaled", 0.0) for o in outputs.values()), default=None),
                          "not_meaningful": {k: o["not_meaningful"] for k, o in outputs.items() if o.get("not_meaningful")}}
                         if ver else None),
        "build_s": (rep.get("buckets") or {}).get("build_s") or rep.get("timings", {}).get("total"),
        "stage_seconds": (rep.get("buckets") or {}).get("stage_seconds") or rep.get("stage_seconds"),
        "peak_rss_mb": rep.get("peak_rss_mb"),
        "buckets": _buckets_summary(rep.get("buckets")),
        "recorded_timings": rep.get("recorded_timings"),
        "host_tail": _host_tail_summary(rep.get("host_tail")),
    }


def _host_tail_summary(rec: dict | None) -> dict | None:
    """A bundle's data-dependent tail (pipeline/host_tail.py): its size, where it starts, what it computes and how
    the whole bundle compared with onnxruntime end to end."""
    if not rec:
        return None
    e2e = rec.get("end_to_end") or {}
    return {"nodes": rec.get("nodes"), "starts_at": rec.get("seeds"), "outputs": rec.get("outputs"),
            "reads": len(rec.get("boundary") or []), "feeds": rec.get("feeds") or [],
            "end_to_end_within_tolerance": e2e.get("within_tolerance"),
            "end_to_end_shapes_differ": sorted(k for k, o in (e2e.get("outputs") or {}).items() if not o.get("same_shape")),
            "tail_ms": e2e.get("tail_ms"), "call_ms": e2e.get("call_ms"),
            "runs_on": rec.get("runs_on", "host"), "placement": rec.get("placement")}


def _timings_line(rt: dict | None) -> str | None:
    """The summary's line on ``--cache-dir``'s recorded timings (``pipeline/timings.py``): taken, or written."""
    if not rt:
        return None
    search = str(rt.get("search") or "")
    replayed = search.startswith("replayed")  # "replayed the recorded build's choice (N rewrites)"
    taken = [f"the search's {search}"] if search and not replayed else []
    if rt.get("rounds") and not rt["rounds"].startswith("timed again"):
        taken.append(f"the results of {rt['rounds']}")
    if rt.get("cpu_choice") and not rt["cpu_choice"].startswith("timed again"):
        taken.append(f"the CPU choice ({rt['cpu_choice']})")
    if taken or replayed:
        did = ([search] if replayed else []) + ([f"took {' and '.join(taken)}"] if taken else [])
        return f"timings: {' and '.join(did)} from {rt['file']} (--remeasure times them again)"
    if rt.get("written"):
        return f"timings: recorded in {rt['written']} for the next build"
    if rt.get("not_written"):
        return f"timings: not recorded ({rt['not_written']}); the next build times them again"
    return None


def _search_line(s: dict) -> str:
    """The summary's line on the rewrite search: what shipped, and what the search proposed where that differs."""
    if s["rewrites_proposed"] is None:
        return f"rewrite search: {s['search']}" if s["search"] != "skipped" else "rewrite search: skipped (--no-search)"
    if s["rewrites"] == s["rewrites_proposed"]:
        return f"rewrite search: {s['search']}"
    return (f"rewrite search: proposed {s['search']}; not shipped: the CPU choice below kept the original model "
            f"({s['nodes_out']} nodes)")


def _buckets_summary(rb: dict | None) -> dict | None:
    """A dynamic-batch bundle's buckets: per bucket its streams and engines, the batch verified between buckets."""
    if not rb:
        return None
    axes = rb.get("axes")  # a grid over named axes: each axis's range, the point verified between buckets
    return {"sizes": rb.get("sizes"), "range": None if axes else [rb.get("min"), rb.get("max")],
            "axes": [f"{a['name']} {a['min']}..{a['max']}" + (" (exact)" if a.get("exact") else "") for a in axes] if axes else None,
            "per_bucket": {s: {"streams": r.get("streams"), "engines": r.get("branches"), "verified": r.get("verified")}
                           for s, r in (rb.get("per_bucket") or {}).items()},
            "verified_between": (rb.get("between") or {}).get("point" if axes else "batch"), "build_s": rb.get("build_s"),
            "memory": rb.get("memory")}


def print_build_summary(bundle, console, verbose: bool = False) -> None:
    """A few lines by default; ``verbose``: the per-branch table, the schedule's estimates, what the CPU build
    timed and the per-output verification figures."""
    from rich.markup import escape

    rep = bundle.report
    s = build_summary(bundle)
    if verbose:
        _print_build_details(bundle, console)
    console.print(escape(f"{s['bundle']}: {plural(s['engines'], s['backend'] + ' engine')} on "
                         f"{plural(s['streams'], 'stream')} ({s['precision']})"))
    console.print(escape(f"  {_search_line(s)}"))
    if s["buckets"]:
        b = s["buckets"]
        rows = ", ".join(f"{n}: {plural(r['engines'], 'engine')} on {plural(r['streams'], 'stream')}"
                         for n, r in b["per_bucket"].items())
        what = "x".join(map(str, b["verified_between"])) if b.get("axes") and b["verified_between"] else b["verified_between"]
        between = f"; verified at {'' if b.get('axes') else 'batch '}{what} between buckets too" if what else ""
        span = ", ".join(b["axes"]) if b.get("axes") else f"batch {b['range'][0]}..{b['range'][1]}"
        console.print(escape(f"  {span} in buckets {b['sizes']} ({rows}){between}; "
                             "the lines above are the largest bucket's"))
    choice = rep.get("cpu_choice")
    if choice and choice.get("timed"):
        timed = ", ".join(f"{t['alternative']} {t['median_ms']:.2f} ms" for t in choice["timed"])
        console.print(escape(f"  CPU: kept {choice['chosen']} (timed here, medians of up to {choice['runs']}: {timed}; "
                             f"{choice.get('decision', '')})"))
    elif choice:
        console.print(escape(f"  CPU: kept {choice['chosen']} ({choice.get('decision', '')})"))
    timings = _timings_line(s["recorded_timings"])
    if timings:
        console.print(escape(f"  {timings}"))
    tail = s["host_tail"]
    if tail:
        seeds = tail["starts_at"] or []
        start = ", ".join(seeds[:3]) + (f" and {len(seeds) - 3} more" if len(seeds) > 3 else "")
        e2e = tail["end_to_end_within_tolerance"]
        differ = tail["end_to_end_shapes_differ"]
        ends = ("" if e2e is None else "; end to end within tolerance of onnxruntime" if e2e
                else f"; end to end, shapes differ from onnxruntime's on {', '.join(differ)}" if differ
                else "; end to end, values outside the tolerance (report.json host_tail.end_to_end)")
        placed = tail.get("placement") or {}
        timed = placed.get("timed") or {}
        where = ("run as torch ops on the GPU after each replay" if tail.get("runs_on") == "gpu"
                 else "run by onnxruntime on the host after each replay")
        if timed:  # (both timed on the build's GPU: host_tail.place)
            where += f" ({timed['gpu_ms']:.2f} ms a call on the GPU, {timed['host_ms']:.2f} on the host)"
        elif placed.get("why") and placed["why"] != "the static part runs on the CPU":
            where += f" (not on the GPU: {placed['why']})"
        console.print(escape(f"  data-dependent tail: {plural(tail['nodes'] or 0, 'node')} from {start} on, computing "
                             f"{', '.join(tail['outputs'] or [])}, {where} "
                             f"(it reads {plural(tail['reads'], 'tensor')} of the plan"
                             + (f" and input {', '.join(tail['feeds'])}" if tail["feeds"] else "") + f"){ends}"
                             + (f"; on the build's input the tail took {tail['tail_ms']:.2f} of a {tail['call_ms']:.2f} ms "
                                "call (its work grows with the candidates above the score threshold)"
                                if tail.get("tail_ms") is not None else "")))
    ver = s["verification"]
    if ver:
        bound = f"<= {ver['scale_tol']}" if ver["criterion"] == "scaled" else "elementwise rtol/atol"
        on = "the original model" + ("'s static part (what the tail reads included)" if tail else "")
        console.print(escape(f"  verification: {ver['status']} against onnxruntime on {on} "
                             f"(max scaled error {ver['max_scaled_error']:.3g}, {bound})"))
        boundary = set((rep.get("host_tail") or {}).get("boundary") or ())
        for name, why in ver["not_meaningful"].items():
            if name not in boundary:
                console.print(f"  [yellow]warning[/yellow]: output {escape(repr(name))} cannot judge the build: {escape(why)}")
        quiet = [n for n in ver["not_meaningful"] if n in boundary]
        if quiet:  # (a tail reads counts and flags that random inputs leave the same: one line, not one each)
            console.print(escape(f"  {plural(len(quiet), 'tensor')} the tail reads cannot judge the build (the same, or "
                                 "near zero, on every input drawn); report.json's verification names them"))
    else:
        console.print("  verification: skipped (--no-verify)")
    if verbose and s["stage_seconds"]:
        console.print(escape("  stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in s["stage_seconds"].items())))
    peak = f", peak memory {s['peak_rss_mb']:.0f} MiB" if s.get("peak_rss_mb") else ""
    console.print(f"  built in {s['build_s'] or 0.0:.1f} s{peak}" + ("" if verbose else "; --verbose for the details"))


def _print_build_details(bundle, console) -> None:
    plan, rep = bundle.plan, bundle.report
    sched = rep.get("schedule", {})
    console.print(schedule_table(plan, title=f"{bundle.path}: {plural(len(plan.branches), plan.backend + ' engine')} on "
                                             f"{plural(plan.num_streams, 'stream')}"))
    s = Table(title="summary")
    s.add_column("")
    s.add_column("value")
    m = rep.get("model", {})
    s.add_row("nodes (input → shipped)", f"{m.get('nodes_in')} → {m.get('nodes_out')}")
    s.add_row("rewrite search", _search_line(build_summary(bundle)).removeprefix("rewrite search: "))
    s.add_row("graph width", str(sched.get("graph_width")))
    requested = sched.get("requested_streams")
    if requested and requested != plan.num_streams:
        s.add_row("streams", f"{plan.num_streams} (of {requested} requested: the schedule found no work for more)")
    s.add_row(f"estimated critical path ({sched.get('cost_model', '')})", _us(sched.get("critical_path_s", 0.0)))
    s.add_row("estimated total work", _us(sched.get("total_work_s", 0.0)))
    s.add_row("build time", f"{rep.get('timings', {}).get('total', 0.0):.2f} s")
    console.print(s)
    choice = rep.get("cpu_choice")
    if choice and choice.get("timed"):
        c = Table(title=f"CPU alternatives timed on this machine ({choice['cores']} cores, up to {choice['runs']} calls each)",
                  caption=choice.get("decision"))
        for col in ("alternative", "streams", "sessions", "threads", "calls", "median ms", "spread", "margin needed", ""):
            c.add_column(col)
        for t in choice["timed"]:
            margin = t.get("margin_needed")
            c.add_row(t["alternative"], str(t["streams"]), str(t["sessions"]), str(t["threads"]), str(t.get("calls", "")),
                      f"{t['median_ms']:.3f}", f"{t['spread']:.0%}" if "spread" in t else "",
                      f"{margin:.0%}" if margin is not None else "default", "kept" if t["chosen"] else "")
        console.print(c)
    ver = rep.get("verification")
    if ver:
        title = "verification against onnxruntime on the original model"
        if ver.get("criterion") == "scaled":
            title += f" (scaled error <= {ver['scale_tol']})"
        console.print(verification_table(ver, title=title))


def inspect_model(path, *, shapes=None, streams=None, device=None, picture=None, search=False, console=None) -> dict:
    """Print op histogram, node count, width, branches and estimated critical path; optionally draw or search."""
    from parastream.rewrite.cost import RooflineCostModel, get_device

    from .analysis import graph_width, op_histogram
    from parastream.launcher.engines import resolve_backend

    from .build import DEFAULT_MAX_STREAMS, BuildConfig, default_device_profile, engine_blocks, plan_streams
    from .model_io import load_model
    from parastream.core.schedule import schedule_graph

    if picture is not None and Path(picture).suffix.lower() not in (".svg", ".png"):
        raise ParastreamError(f"--picture {picture}: the file name must end in .svg or .png")
    loaded = load_model(path, shapes, host_tail=True)  # as a build loads it: a detector's static part
    model = loaded.model
    hist = op_histogram(model)
    width, _ = graph_width(loaded.graph)
    # the device profile a default build would plan for, so that inspect reports the streams the build makes
    backend = resolve_backend("auto")
    profile = device or default_device_profile(backend)
    cm = RooflineCostModel(profile)
    cpu = get_device(profile).name == "CPU"
    graph = loaded.graph
    # ... and its engines: a one-stream plan cut into repeated blocks where that backend's build cuts it
    sched, tried = plan_streams(graph, cm, streams, DEFAULT_MAX_STREAMS, blocks=engine_blocks(BuildConfig(), backend))
    one = schedule_graph(graph, 1, cm.node_cost, cm.is_memory_bound)
    k = sched.num_streams

    t = Table(title=f"{path}: {len(model.graph.node)} nodes")
    t.add_column("op")
    t.add_column("count", justify="right")
    for op, n in hist.most_common():
        t.add_row(op, str(n))
    console.print(t)
    s = Table(title=f"parallelism: the cost model's estimates for {get_device(profile).name}, not measured")
    s.add_column("")
    s.add_column("value")
    s.add_row("nodes", str(len(model.graph.node)))
    s.add_row("graph width (largest set of mutually independent nodes)", str(width))
    s.add_row("streams (estimated best)", str(sched.num_streams))
    s.add_row("branches (engines)", str(len(sched.branches)))
    s.add_row(f"estimated critical path on {plural(sched.num_streams, 'stream')}", _us(sched.makespan))
    s.add_row("estimated total work (= 1 stream)", _us(one.makespan))
    s.add_row("estimated speed-up from streams", f"{one.makespan / sched.makespan:.2f}x" if sched.makespan else "-")
    console.print(s)
    if loaded.tail is not None:
        tail = loaded.tail
        console.print(f"data-dependent tail: {plural(len(tail.model.graph.node), 'node')} from {', '.join(tail.seeds[:3])}"
                      f"{' and more' if len(tail.seeds) > 3 else ''} on, computing {', '.join(tail.outputs)}: a build "
                      "runs them after each replay, in onnxruntime on the host or as torch ops on the GPU, whichever it "
                      "times faster; the figures above are the static part's")
    if cpu:
        console.print("CPU: these stream estimates are not measured; a CPU build times the plan against one "
                      "onnxruntime session with every core, and ships one session unless the plan is timed faster "
                      "beyond the noise (`build --verbose` shows the timings)")
    if len(tried) > 1:
        kt = Table(title="number of streams (engines cost 3 µs, events 2 µs; more streams only when ≥ 10% faster)")
        for col in ("streams", "engines", "events", "critical path", "estimated latency", ""):
            kt.add_column(col, justify="right")
        for t in tried:
            kt.add_row(str(t["streams"]), str(t["engines"]), str(t["events"]), _us(t["critical_path_s"]), _us(t["estimated_s"]),
                       "chosen" if t["chosen"] else "")
        console.print(kt)
    bt = Table(title="branches")
    for col in ("branch", "stream", "nodes", "first … last", "bound", "est."):
        bt.add_column(col, overflow="fold")
    for bid in sched.launch_order:
        nodes = sched.branches[bid]
        span = nodes[0] if len(nodes) == 1 else f"{nodes[0]} … {nodes[-1]}"
        bt.add_row(f"branch_{bid:03d}", str(sched.branch_stream[bid]), str(len(nodes)), span, sched.branch_bound[bid], _us(sched.branch_time[bid]))
    console.print(bt)
    if picture:
        from .picture import draw_graph

        branches = {name: b for b, nodes in enumerate(sched.branches) for name in nodes}
        draw_graph(model, picture, streams=sched.node_stream, branches=branches, title=f"{Path(path).name}: {plural(sched.num_streams, 'stream')}, {plural(len(sched.branches), 'branch')}")
        console.print(f"picture written: {picture}")
    result = {"nodes": len(model.graph.node), "width": width, "streams": sched.num_streams, "branches": len(sched.branches),
              "streams_tried": tried,
              "critical_path_s": sched.makespan, "total_work_s": one.makespan, "ops": dict(hist)}
    if search:
        from parastream.rewrite import optimize

        _, rep = optimize(model, cost_model=cm, streams=k)
        try:
            from parastream.rewrite.search import format_report

            console.print(format_report(rep))
        except ImportError:
            console.print_json(data=rep)
        result["search"] = rep
    return result
