
set -e
export GIT_AUTHOR_DATE="2024-01-01T12:00:00Z" GIT_COMMITTER_DATE="2024-01-01T12:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main
git config user.name "Dev" && git config user.email dev@example.com
c() { git add -A && git commit -qm "$1"; }
printf '1.0.0\n' > VERSION
printf 'app\n' > app.txt
c "Initial commit"
git checkout -q -b feature
printf '1.1.0\n' > VERSION
printf 'new feature\n' > feature.txt
c "Add feature, bump version"
git checkout -q main
printf '1.0.1\n' > VERSION
printf 'hotfix\n' > hotfix.txt
c "Hotfix"
