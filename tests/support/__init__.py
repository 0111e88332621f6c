"""What several test files share, importable so that no test module imports another."""
