
set -e
export GIT_AUTHOR_DATE="2024-01-01T12:00:00Z" GIT_COMMITTER_DATE="2024-01-01T12:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main
git config user.name "Dev" && git config user.email dev@example.com
c() { git add -A && git commit -qm "$1"; }
printf 'DEBUG = False\n' > settings.py
printf '# Service\n\nSet the api key in the environment.\n' > README.md
c "Initial commit"
printf 'def main():\n    pass\n' > main.py
c "Add entry point"
printf 'DEBUG = False\nTIMEOUT = 30\n' > settings.py
c "Update settings"
printf 'DEBUG = False\nTIMEOUT = 30\nAPI_KEY = "sk-live-4f9a7c21e8b3d605"\n' > settings.py
c "Update settings"
printf 'def main():\n    print("hi")\n' > main.py
c "Print greeting"
printf 'DEBUG = False\nTIMEOUT = 30\n' > settings.py
c "Clean up settings"
printf 'requests\n' > requirements.txt
c "Add requirements"
printf '# Changes\n' > CHANGELOG.md
c "Add changelog"
