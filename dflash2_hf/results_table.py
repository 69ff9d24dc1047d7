"""The results table of a benchmark run, shared by ``bench``'s results.md and an exported drafter's model card
(which sits below the benchmark and so cannot import it)."""

from __future__ import annotations


def markdown_table(rows: list[dict]) -> str:
    """One markdown row per method and temperature of a benchmark summary (``summarize``'s rows); a figure the
    method does not report is a dash."""
    lines = ["| method | T | tok/s | speedup (median [q1, q3]) | vs packed plain | same tokens as plain | greedy differences | mean acceptance | drafted tokens verified | oracle acceptance | top-1 / top-K recall @1 | selector share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        acceptance = f"{row['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in row else "–"
        verified = f"{row['mean_verified_drafted_tokens']:.1f}" if "mean_verified_drafted_tokens" in row else "–"
        oracle = f"{row['oracle_acceptance_length']:.2f}" if "oracle_acceptance_length" in row else "–"
        recall = (f"{row['top1_recall_by_position'][0]:.2f} / {row['topk_recall_by_position'][0]:.2f}"
                  if row.get("top1_recall_by_position") else "–")
        share = f"{100 * row['select_share']:.1f}%" if "select_share" in row else "–"
        same = f"{row['same_tokens_as_plain']}/{row['runs']}" if "same_tokens_as_plain" in row else "–"
        over_packed = (f"{row['speedup_over_packed_plain_median']:.2f}" if "speedup_over_packed_plain_median" in row
                       else "–")
        lines.append(f"| {row['method']} | {row['temperature']:g} | {row['tokens_per_second']:.1f} | "
                     f"{row['speedup_median']:.2f} [{row['speedup_q1']:.2f}, {row['speedup_q3']:.2f}] | {over_packed} | {same} | {_differences(row)} | {acceptance} | {verified} | "
                     f"{oracle} | {recall} | {share} |")
    return "\n".join(lines)


def _differences(row: dict) -> str:
    """How the greedy runs that are not plain decoding's tokens parted from them: at near-ties of plain decoding's
    logits, or where its choice was clear (a bug); ``none`` where every run matched, a dash where none was compared."""
    if "near_ties" not in row:
        return "–"
    parts = [f"{row[key]} {name}" for key, name in (("near_ties", "near-tie"), ("clear_differences", "CLEAR (a bug)"))
             if row[key]]
    return ", ".join(parts) or "none"


__all__ = ["markdown_table"]
