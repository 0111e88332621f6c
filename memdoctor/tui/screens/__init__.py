"""The TUI's tabs, one module each (overview, timeline, modules, findings, remedies), and
the help screen. Each tab is a TabPane that draws what the app hands it; none loads,
traces or diagnoses."""
