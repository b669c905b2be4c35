"""The feed importer of Celery's Task Cookbook, without the hand-written lock."""

import time

from celery import shared_task

from celery_baton import fence


@shared_task(exclusive="feed_url")
def import_feed(feed_url: str, seconds: float = 1.0) -> dict[str, object]:
    """Import one feed; at most one import per ``feed_url`` runs at a time, anywhere.

    A second import of the same feed while this one runs is skipped: acknowledged, not
    run, logged, and its result is a ``TaskSkipped`` failure naming this run's task id.
    """
    token = fence()  # store it with the feed: UPDATE ... WHERE fence < :fence
    time.sleep(seconds)  # stands in for downloading and saving the feed
    return {"feed_url": feed_url, "fence": token}
