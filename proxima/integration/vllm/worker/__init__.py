"""The worker side: the store that writes compressed slots, and what runs beside it in each worker process."""
