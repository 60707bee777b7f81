# /etc/profile.d/fsagent.sh: the agent's work-folder variables in a login
# shell. build-rootfs.sh puts the line `fsagent_run_env=<file>` above this:
# the env file fsagent-bridge.service writes from the run's bindings; where it
# is missing, /etc/fsagent/agent.env, the fixed one for the four folders
# fsagent@*.service mounts (a scope the run does not bind is an empty
# read-only directory).
#
# The file is decoded here, never run: every login shell reads this script,
# root's too, and the agent may write its own env file. A value is
# `KEY="..."` with a backslash before each \ " $ ` (fsagent/commands/envfile.py, which
# systemd and `set -a; . FILE` read the same way); an unquoted value (a file
# of an older fsagent) is taken as it is. POSIX sh: dash runs it too.
fsagent_export_env() {
    while IFS= read -r fsagent_line || [ -n "$fsagent_line" ]; do
        fsagent_key=${fsagent_line%%=*}
        case $fsagent_key in
            "$fsagent_line" | '' | [0-9]* | *[!A-Za-z0-9_]*) continue ;;
        esac
        fsagent_value=${fsagent_line#*=}
        case $fsagent_value in
            \"*\")
                fsagent_rest=${fsagent_value#\"}
                fsagent_rest=${fsagent_rest%\"}
                fsagent_value=
                while :; do
                    case $fsagent_rest in
                        *\\*)
                            fsagent_value=$fsagent_value${fsagent_rest%%\\*}
                            fsagent_rest=${fsagent_rest#*\\}
                            fsagent_next=${fsagent_rest%"${fsagent_rest#?}"}
                            fsagent_rest=${fsagent_rest#?}
                            # As sh: only these four lose their backslash.
                            case $fsagent_next in
                                [\"\\\$\`]) fsagent_value=$fsagent_value$fsagent_next ;;
                                *) fsagent_value=$fsagent_value\\$fsagent_next ;;
                            esac
                            ;;
                        *)
                            fsagent_value=$fsagent_value$fsagent_rest
                            break
                            ;;
                    esac
                done
                ;;
        esac
        export "$fsagent_key=$fsagent_value"
    done <"$1"
}
for fsagent_env in "$fsagent_run_env" /etc/fsagent/agent.env; do
    if [ -r "$fsagent_env" ]; then
        fsagent_export_env "$fsagent_env"
        break
    fi
done
unset -f fsagent_export_env
unset fsagent_env fsagent_run_env fsagent_line fsagent_key fsagent_value fsagent_rest fsagent_next
