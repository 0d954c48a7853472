"""Analysis of recorded steps: one merged timeline per step, summaries, step-to-step diffs, and
HTML reports. Streams trace files (never loads one whole); imports neither Ray nor HTTP code.

    merge.merge_step(store, k)          step_<k>/merged.trace.json.gz (+ merge.json)
    summary.summarize_step(store, k)    StepSummary: per process and across replicas
    diff.diff_steps(a, b)               StepDiff: what got slower, by phase and by op
    report.write_reports(store)         step_<k>/report.html and index.html
"""
