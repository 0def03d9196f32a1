import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nodepool.settings")
# Web processes get the web statement timeout (nodepool/settings.py), as under WSGI (nodepool/wsgi.py).
os.environ.setdefault("NODEPOOL_PROCESS_KIND", "web")
application = get_asgi_application()
