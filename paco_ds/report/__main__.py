"""`python -m paco_ds.report runs/<name>`: the run's report.html, rebuilt from its directory."""
from paco_ds.report.page import main

main()
