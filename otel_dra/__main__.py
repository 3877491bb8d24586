from otel_dra.cli import main

raise SystemExit(main())
