"""The ``evobus`` command: main (the entry point), verbs (every verb's arguments and
help; a verb's code is imported only when it runs), one module per verb family (run,
groups, remote, replay, report, inspect, fork), progress and live (the live views),
figures (the fold of a run's messages both the live panel and `inspect --summary`
read), learned (what a run learned, from its log), analysis (a log read for its report)
and render (HTML reports).
Nothing else imports this package."""
