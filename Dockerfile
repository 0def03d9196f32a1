# nodepool: one image for web (gunicorn), the Celery worker, beat and the one-shot migrate.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NODEPOOL_VAR_DIR=/var/lib/nodepool

WORKDIR /app
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt

COPY . .
# Static files (admin, API docs) are collected into the image and served by whitenoise.
# The build-time SECRET_KEY only lets settings load; the real one comes from the environment.
RUN useradd --system --uid 10001 --home-dir /var/lib/nodepool nodepool \
    && mkdir -p /var/lib/nodepool \
    && SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput -v0 \
    && chown -R nodepool /var/lib/nodepool

USER nodepool
EXPOSE 8000
CMD ["gunicorn", "nodepool.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "2", \
     "--access-logfile", "-", "--graceful-timeout", "5"]
