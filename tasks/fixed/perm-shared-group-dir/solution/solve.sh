#!/usr/bin/env bash
set -e
groupadd devs
useradd -m -G devs alice
useradd -m -G devs bob
mkdir -p /srv/shared
chown root:devs /srv/shared
chmod 2770 /srv/shared
