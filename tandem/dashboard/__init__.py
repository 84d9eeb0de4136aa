"""`tandem dashboard`: what a run records for its page (`record`), reading it back (`store`), and the page (`app`, `static/`). See docs/dashboard.md."""
