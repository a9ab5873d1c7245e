"""`kvpolicy serve`: the HTTP decision service, its metrics and its policy reloading.

Importing this package loads nothing of the server stack: `api` is plain pydantic
(`kvpolicy schema` publishes it); `app` imports starlette.
"""
