"""The configuration reference in the docs is the generator's output from the models' field
docstrings: a field added or reworded without regenerating the page fails here."""

from rlmesh.job import Job
from rlmesh.reference.configuration import reference
from tests.support.paths import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "reference" / "configuration.md"


def test_the_committed_reference_is_what_the_models_generate():
    assert PAGE.read_text() == reference(), (
        "regenerate it: python -m rlmesh.reference.configuration > docs/reference/configuration.md"
    )


def test_the_reference_documents_every_section_and_a_field_by_its_docstring():
    page = reference()
    for section in Job.model_fields:
        assert f"`[{section}]`" in page or f"`[[{section}]]`" in page
    assert "| `micro_batch_max_tokens` | int | `0` | Token budget of a micro-batch" in page
