
set -e
export GIT_AUTHOR_DATE="2024-01-01T12:00:00Z" GIT_COMMITTER_DATE="2024-01-01T12:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main
git config user.name "Dev" && git config user.email dev@example.com
c() { git add -A && git commit -qm "$1"; }
mkdir -p src
printf 'def greet(name):\n    return "Hello " + name\n' > src/app.py
printf '# Demo\n' > README.md
c "Initial commit"
printf 'def greet(name):\n    return f"Hello, {name}!"\n' > src/app.py
printf '# Demo\n\nWork in progress.\n' > README.md
echo scratch > notes.tmp
