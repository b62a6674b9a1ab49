"""The Grafana dashboard ``mars dashboard --out FILE.json`` writes: what it shows
(:mod:`mars.dashboard.panels`, plain data) and the dashboard built from it with Grafana's
foundation SDK (:mod:`mars.dashboard.grafana`)."""
