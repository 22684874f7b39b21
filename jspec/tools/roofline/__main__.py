"""python -m jspec.tools.roofline --synthetic NAME[,NAME] ...: see ``jspec.tools.roofline.run``."""

from jspec.tools.roofline.run import main

raise SystemExit(main())
