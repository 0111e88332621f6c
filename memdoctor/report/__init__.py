"""Renderers: text (rich), JSON and HTML. They read Runs, Breakdowns and findings and
never touch torch."""
