import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nodepool.settings")
# Web processes get the web statement timeout (nodepool/settings.py); Celery, beat, migrations
# and management commands never import this module and keep the longer one.
os.environ.setdefault("NODEPOOL_PROCESS_KIND", "web")
application = get_wsgi_application()
