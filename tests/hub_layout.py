"""Hub datasets as the hub serves them, built from flat TL;DR rows: the hub's comparison rows,
and repositories in the hub cache's own layout (read offline by ``huggingface_hub``)."""

from __future__ import annotations

from pathlib import Path


def to_hub_comparison(row: dict) -> dict:
    """The inverse of the flat format: the hub's `openai/summarize_from_feedback` comparison row."""
    chosen = {"text": " " + row["chosen"], "policy": row["chosen_policy"], "note": row.get("chosen_note")}
    rejected = {"text": " " + row["rejected"], "policy": row["rejected_policy"], "note": row.get("rejected_note")}
    choice = row["choice"]
    summaries = [chosen, rejected] if choice == 0 else [rejected, chosen]
    is_news = row.get("subreddit") is None
    info = {
        "id": row["id"],
        "post": None if is_news else row["post"],
        "title": row["title"],
        "subreddit": row["subreddit"],
        "site": row.get("site"),
        "article": row["post"] if is_news else None,
    }
    return {
        "info": info,
        "summaries": summaries,
        "choice": choice,
        "worker": row["worker"],
        "batch": row["batch"],
        "split": row["orig_split"],
        "extra": {"confidence": row["confidence"]},
    }


def hub_cache_repo(
    cache: Path,
    repo_id: str,
    commit: str,
    files: dict[str, list[dict] | str],
    ref: str | None = "main",
    repo_type: str = "dataset",
) -> Path:
    """A repository ``repo_id`` (a dataset, or a ``model``) at ``commit`` in the hub cache
    ``cache``, as ``huggingface_hub`` leaves it after a download:
    ``{repo_type}s--OWNER--NAME/snapshots/COMMIT/`` holding ``files`` (rows saved as Parquet by
    ``datasets``, text as given), and ``refs/REF`` naming the commit. Returns the snapshot folder."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = snapshot / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            import datasets

            datasets.Dataset.from_list(content).to_parquet(str(path))
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
