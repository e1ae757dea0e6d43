"""A run's report page (`page`): `python -m paco_ds.report runs/<name>` rebuilds `report.html`."""
