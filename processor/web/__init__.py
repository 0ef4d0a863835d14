"""The processor's web view and one-file HTML reports (docs/web.md).

view.py builds a JSON-safe view model from a finished analysis (pure); svg.py and
pages.py draw it (pure); feed.py refreshes each run once per tick for every open
page; app.py is the framework-independent request handler; server.py serves it on
`--ui`; report.py writes `report.html` and `compare.html`. Nothing here analyses or
diagnoses, and nothing is fetched from the network at run time.
"""
