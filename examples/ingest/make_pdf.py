"""Write guide.pdf beside this file (a two-page PDF, by hand: see tests/support/documents.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.documents import minimal_pdf

PAGES = [
    "Ingestion guide\n\n"
    "Upload a file, then submit the ingest.file pipeline with its blob name.\n"
    "The parse stage extracts the text of every page of a PDF.",
    "Chunks and points\n\n"
    "Each chunk becomes one point in Qdrant, with an id that depends only on\n"
    "the tenant, the file name, the chunk index and the pipeline version.",
]

if __name__ == "__main__":
    target = Path(__file__).with_name("guide.pdf")
    target.write_bytes(minimal_pdf(PAGES))
    print(f"wrote {target}")
