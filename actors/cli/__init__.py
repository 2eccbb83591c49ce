"""The ``evobus`` command: main (verbs and dispatch), one module per verb family
(groups, remote, replay, report), progress (live views) and render (HTML reports).
Nothing else imports this package."""
