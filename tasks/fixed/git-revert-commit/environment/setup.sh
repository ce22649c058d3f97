
set -e
export GIT_AUTHOR_DATE="2024-01-01T12:00:00Z" GIT_COMMITTER_DATE="2024-01-01T12:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main
git config user.name "Dev" && git config user.email dev@example.com
c() { git add -A && git commit -qm "$1"; }
printf 'print("service")\n' > app.py
printf '[server]\nport = 8080\nhost = 0.0.0.0\n' > config.ini
c "Initial commit"
printf 'import logging\n' > log.py
c "Add logging"
sed -i 's/port = 8080/port = 9999/' config.ini
c "Change default port"
printf '# Docs\n' > docs.md
c "Add docs"
