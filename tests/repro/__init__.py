"""Reproductions of the findings of "No silent wrong answers", one test each, written against today's
public API and marked xfail(strict=True): each asserts the correct behaviour, so a fix turns it into an
unexpected pass and the marker must be removed."""
