# Quoting for the files the packaging scripts write; sourced (bash) by
# install-fsagent.sh and sandbox-image/build-rootfs.sh.

# env_quote VALUE: VALUE as an env file value, the quoting fsagent itself
# writes (fsagent/commands/envfile.py): double quotes, a backslash before each \ " $ `.
# systemd's EnvironmentFile=, POSIX sh (`set -a; . FILE`), fsagent's reader
# and /etc/profile.d/fsagent.sh all read it back as VALUE. A newline has no
# such quoting: refused (use it in an assignment, `q=$(env_quote "$v")`, so
# `set -e` stops the script).
env_quote() {
    local v=$1
    if [[ $v == *$'\n'* ]]; then
        echo "env_quote: a value with a newline cannot go into an env file: ${v@Q}" >&2
        return 1
    fi
    v=${v//\\/\\\\}
    v=${v//\"/\\\"}
    v=${v//\$/\\\$}
    v=${v//\`/\\\`}
    printf '"%s"' "$v"
}

# sh_quote VALUE: VALUE as one POSIX sh word (single quotes; ' as '\'').
sh_quote() {
    local q="'\\''"
    printf "'%s'" "${1//\'/$q}"
}
